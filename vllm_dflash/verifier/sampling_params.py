"""Per-request temperature, min-p, top-k and top-p, applied to logits the way vLLM samples.

vLLM 0.32's Sampler (non-speculative decoding and the bonus token) divides by
the temperature (greedy rows by 1), applies min-p, then top-k and top-p
(`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`). Its rejection sampler
skips min-p at draft positions (`apply_sampling_constraints`), so with min_p set
the tokens it emits there follow another distribution than plain sampling; we
apply the same chain at every position so speculation stays lossless.

Conventions follow vLLM's input batch: temperature 0 (below 1e-5) marks a greedy
request, top_k = vocab size (or <= 0) and top_p = 1 disable the filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SAMPLING_EPS = 1e-5


def expand_per_request(values: torch.Tensor | None, rows_per_request: Sequence[int]) -> torch.Tensor | None:
    """[B] per-request values -> one per row; request b owns rows_per_request[b] rows."""
    if values is None:
        return None
    counts = torch.as_tensor(list(rows_per_request), dtype=torch.long)
    return values.repeat_interleave(counts.to(values.device), output_size=int(counts.sum()))


def greedy_mask(temperature: torch.Tensor | None, num_rows: int, device: torch.device) -> torch.Tensor:
    """True where a row decodes greedily; temperature None means every row does."""
    if temperature is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    return temperature < SAMPLING_EPS


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """In place; greedy rows are divided by 1 (their argmax is what counts)."""
    temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature.float())
    return logits.div_(temperature[:, None])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens whose probability is below min_p * max probability."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.float()[:, None]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """In place: keep the k largest logits (ties with the k-th kept), then the smallest
    set of largest-probability tokens whose mass exceeds top_p (at least one)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        kth_largest = ascending.gather(1, (vocab - k)[:, None])
        ascending.masked_fill_(ascending < kth_largest, float("-inf"))
    if top_p is not None:
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = mass_below <= 1 - top_p.float()[:, None]
        dropped[:, -1] = False
        ascending.masked_fill_(dropped, float("-inf"))
    return logits.scatter_(1, order, ascending)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 logits after temperature, min-p, top-k, top-p (all per row); in place when float32."""
    logits = logits.float()
    if temperature is None:  # all greedy: filters never change the argmax
        return logits
    apply_temperature(logits, temperature)
    if min_p is not None:
        apply_min_p(logits, min_p)
    return apply_top_k_top_p(logits, top_k, top_p)


def target_for_verifier(
    logits: torch.Tensor, greedy_rows: torch.Tensor | None, *, all_greedy: bool, all_random: bool
) -> torch.Tensor:
    """Probabilities for sampled rows, logits kept for greedy rows.

    The verifier only takes the argmax of greedy rows; keeping their logits
    makes ties resolve exactly as vLLM's argmax over logits does. The flags
    come from the caller (vLLM's SamplingMetadata has them) to avoid a device sync.
    """
    if all_greedy:
        return logits
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    if all_random or greedy_rows is None:
        return probs
    return torch.where(greedy_rows[:, None], logits, probs)
