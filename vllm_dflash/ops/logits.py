"""logits_top2: the draft's tokens and their confidence in one pass over the vocabulary;
logits_argmax: the tokens alone, by the same pass on CPU."""

from __future__ import annotations

import torch

from vllm_dflash.ops import dispatch, reference


def logits_top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` ``[rows, vocab]``: (argmax ``[rows]`` int64, its first index on
    ties as torch.argmax; top-1 minus top-2 logit ``[rows]`` float32, 0 on a tie).
    :func:`reference.logits_top2_ref`'s results exactly (rows holding NaN aside). The draft's
    token and its confidence (`adaptive.confidence`) in one pass over the vocabulary: on
    CPU, torch's topk(2) and argmax take ~2 ns an element on a thread (1.4 ms for 15 rows
    of a 150k vocabulary; a bf16 argmax 7 ms)."""
    if not dispatch.use_native("logits_top2", logits.device.type):
        return reference.logits_top2_ref(logits)
    return torch.ops.vllm_dflash.logits_top2(logits)


def logits_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, first index on ties, any leading shape: on CPU by
    :func:`logits_top2`'s one vectorised pass (torch's argmax there takes ~2 ns an element,
    ~10 in bf16), elsewhere torch's own."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return logits_top2(logits.reshape(-1, logits.shape[-1]))[0].view(logits.shape[:-1])
