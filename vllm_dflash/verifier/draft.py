"""Sampled draft tokens with per-request parameters and generators.

The proposer draws sampled drafts here rather than through vLLM's draft
sampler so that a seeded request draws from its own generator (reproducible
outputs); the verifier tests draw with the same law.

"argmax" drafting proposes each position's most likely token; the verifier
treats it as a point mass and needs no probabilities. "sample" drafting draws
each token from q = the draft's distribution after the request's own
temperature, min-p, top-k and top-p, and must hand that q to the verifier
(vLLM: `take_last_draft_probs()` on the proposer). Filtering q like p raises
acceptance; correctness only needs the tokens to be drawn from the q handed over.
Greedy requests always draft the argmax.
"""

from __future__ import annotations

import torch

from vllm_dflash import ops
from vllm_dflash.verifier import sampling_params

DRAFT_SAMPLE_METHODS = ("argmax", "sample")


def sample_drafts(
    logits: torch.Tensor,
    method: str,
    *,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, K, V] -> (draft ids [B, K] int64, q [B, K, V] float32 or None).

    Per-request [B] parameters as vLLM's SamplingMetadata holds them
    (temperature None: all requests greedy). q is None for argmax drafting and
    for all-greedy batches; rows of greedy requests in q are never read.
    """
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample must be one of {DRAFT_SAMPLE_METHODS}, got {method!r}")
    if logits.dim() != 3:
        raise ValueError(f"draft logits must be [batch, num_draft_tokens, vocab], got {list(logits.shape)}")
    greedy_ids = ops.logits_argmax(logits)
    if method == "argmax" or temperature is None:
        return greedy_ids, None
    batch, k, vocab = logits.shape
    expand = lambda t: None if t is None else t.repeat_interleave(k)  # noqa: E731
    processed = sampling_params.process_logits(
        logits.reshape(batch * k, vocab).float().clone(), expand(temperature), expand(top_k),
        expand(top_p), expand(min_p))
    probs = processed.softmax(dim=-1, dtype=torch.float32).view(batch, k, vocab)
    noise = torch.empty_like(probs).exponential_()
    for b, generator in sorted((generators or {}).items()):
        noise[b].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    greedy = sampling_params.greedy_mask(temperature, batch, logits.device)
    return torch.where(greedy[:, None], greedy_ids, sampled), probs
