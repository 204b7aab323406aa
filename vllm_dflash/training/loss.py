"""DFlash's position-weighted block loss and the per-position metrics that go with it.

Position k of a block (k = 1..B-1) predicts token anchor+k. An error at k makes
every later draft token useless (verification accepts a prefix), so early
positions matter most: w_k = exp(-(k-1)/gamma). Position 0 is the anchor itself
(known, weight 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The paper's decay per block size; other sizes scale gamma with B.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return PAPER_GAMMA.get(block_size, 7.0 * block_size / 16)


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[B] float weights; gamma=None turns decay off (uniform weight 1 for k >= 1)."""
    if gamma is not None and not gamma > 0:
        raise ValueError(f"gamma={gamma}: the loss decay needs gamma > 0 (or no decay)")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if gamma is None else torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, N, B] token ids at anchor+k (anchors must leave room for the block)."""
    idx = anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)
    return torch.gather(tokens, 1, idx.flatten(1)).view(idx.shape)


def loss_normalizer(keep: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The total loss weight of a batch: sum over kept blocks of w_1 + ... + w_(B-1)."""
    return keep.sum().to(torch.float64) * weights[1:].double().sum().to(keep.device)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor,
               weights: torch.Tensor, normalizer: torch.Tensor | float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted mean cross-entropy over the predicted positions.

    logits: [batch, N, B-1, V] for positions 1..B-1; labels: [batch, N, B];
    keep: [batch, N]; weights: [B]. `normalizer` divides the weighted sum instead
    of this batch's own total weight (data parallel: the global batch's total, so
    every rank's share adds up to the one-process loss). Returns (loss, stats) with stats holding
    per-position sums (index k = block position) so callers can aggregate:
    `correct`/`count` [B] and `streak` (sum over blocks of the run of correct
    drafts from position 1, i.e. the greedy acceptance a block would get) and
    `blocks`.
    """
    target = labels[..., 1:]
    logits = logits.float()   # argmax and log-softmax are much faster in float32 on CPU than bf16
    ce = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none")
    ce = ce.view(target.shape)
    w = weights[1:].to(ce.device).view(1, 1, -1) * keep.unsqueeze(-1)
    total = (w.sum().clamp(min=1e-6) if normalizer is None
             else torch.as_tensor(normalizer, dtype=ce.dtype, device=ce.device).clamp(min=1e-6))
    loss = (ce * w).sum() / total
    with torch.no_grad():
        # target logit == row max <=> argmax hits (up to exact ties); amax is 5x faster than argmax on CPU.
        hit = (logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) >= logits.amax(-1)) & keep.unsqueeze(-1)
        pad = torch.zeros(1, dtype=torch.long, device=ce.device)
        correct = torch.cat([pad, hit.sum((0, 1))])
        count = torch.cat([pad, keep.sum().expand(target.shape[-1])])
        streak = hit.long().cumprod(-1).sum(-1)[keep].sum()
        stats = {"correct": correct, "count": count, "streak": streak, "blocks": keep.sum(),
                 "weighted_ce": (ce * w).sum(),
                 "ce_sum": (ce * keep.unsqueeze(-1)).sum(), "ce_count": keep.sum() * target.shape[-1]}
    return loss, stats

