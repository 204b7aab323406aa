"""rejection_sample: the verifier's accept / recover step.

Arguments already in the op's dtypes and layout; vllm_dflash.verifier.rejection
checks and casts them (ValueError naming the argument) before calling this.
Semantics: vllm_dflash.ops.reference (rejection_sample_ref).
"""

from __future__ import annotations

import torch

from vllm_dflash.ops import dispatch, reference


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    bonus_token_ids: torch.Tensor | None,
    is_greedy: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    exp_noise: torch.Tensor | None,
    max_spec_len: int,
) -> torch.Tensor:
    """[B, max_spec_len + 1] int32 tokens, -1 after the emitted ones."""
    args = (draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs, bonus_token_ids, is_greedy, uniforms,
            exp_noise, max_spec_len)  # fmt: skip
    if not dispatch.use_native("rejection_sample", target_probs.device.type):
        return reference.rejection_sample_ref(*args)
    return torch.ops.vllm_dflash.rejection_sample(*args)
