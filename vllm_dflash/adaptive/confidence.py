"""The draft's own confidence at each position, the input of the acceptance model.

Two features of the draft logits at a position, each as (feature in [0, 1]
for binning, the probability it stands for, which is the calibration's
prior):

* "margin": d = top-1 minus top-2 logit; feature tanh(d / 2) (= (p1 - p2) /
  (p1 + p2)), prior sigmoid(d) (= p1 / (p1 + p2), the two-way probability).
  One pass over the vocabulary gives it with the argmax (`ops.logits_top2`).
* "top1": p1 = softmax top-1 probability, feature and prior both p1. Costs a
  log-sum-exp over the vocabulary.

A sampled draft (T > 0, draft_sample "sample") is accepted with probability
min(1, p(x) / q(x)) for the token x it drew from q: its confidence is q(x)
(`sampled_confidence`), not the top-1 of the logits, which may not be x.

Measured (scripts/adaptive_features.py; bundled pair, float32, k = 15, full
blocks, 36 greedy and 36 T = 1 requests, 1,897 verified drafts, prequential
log loss of the online acceptance model, lower is better): greedy drafts
margin 0.426, top-1 0.412, position only 0.577; with each request's own
shift (calibration.RequestOffsets) the margin gets 0.413, as good as the
top-1 probability, which needs a log-sum-exp over the vocabulary for every
drafted position where the margin needs one top-2 pass: the margin is the
default. Sampled drafts scored by the logits' margin or top-1 did worse than
position alone (0.641, 0.609 vs 0.603); q(x) with the request's shift gets
0.597: hence q(x) for them.
"""

from __future__ import annotations

import torch

from vllm_dflash import ops

FEATURES = ("margin", "top1")
DEFAULT_FEATURE = "margin"


def _scored(logits: torch.Tensor, feature: str):
    """(argmax ids, feature, prior): the one pass over the vocabulary both functions below
    make (`ops.logits_top2` for the margin: argmax and margin together, ties at argmax's
    first index)."""
    if feature not in FEATURES:
        raise ValueError(f"confidence feature {feature!r}: choose one of {FEATURES}")
    if feature == "margin":
        ids, d = ops.logits_top2(logits)
        return ids, torch.tanh(d / 2), torch.sigmoid(d)
    x = logits.float()
    values, ids = x.max(dim=-1)
    p1 = torch.exp(values - torch.logsumexp(x, dim=-1))
    return ids, p1, p1


def draft_confidence(logits: torch.Tensor, feature: str = DEFAULT_FEATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (feature [N], prior [N]), float32, on the logits' device."""
    _, feat, prior = _scored(logits, feature)
    return feat, prior


def argmax_with_confidence(logits: torch.Tensor, feature: str = DEFAULT_FEATURE
                           ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """logits [N, V] -> (argmax ids [N] int64, (feature [N], prior [N])) in one pass
    over the vocabulary where the feature allows: `ops.logits_top2` gives the margin
    with the argmax, and the top-1 probability's max holds it. A draft's LM-head rows are
    as long as the vocabulary (150k for Qwen3), so a second pass costs about as
    much as the confidence itself. Ties keep argmax's first index (topk does not
    promise it), so adaptive and static drafts are the same tokens."""
    ids, feat, prior = _scored(logits, feature)
    return ids, (feat, prior)


def sampled_confidence(conf: tuple[torch.Tensor, torch.Tensor], probs: torch.Tensor, draft_ids: torch.Tensor,
                       sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature, prior) with rows where `sampled` [N] replaced by q(x): the
    probability [N, V] `probs` gave the drawn token `draft_ids` [N]."""
    qx = probs.gather(1, draft_ids.long().view(-1, 1)).squeeze(1).float()
    feature, prior = conf
    return torch.where(sampled, qx, feature), torch.where(sampled, qx, prior)
