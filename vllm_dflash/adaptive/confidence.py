"""The draft's own confidence at each position, the input of the acceptance model.

Two features of the draft logits at a position, each as (feature in [0, 1]
for binning, the probability it stands for, which is the calibration's
prior):

* "margin": d = top-1 minus top-2 logit; feature tanh(d / 2) (= (p1 - p2) /
  (p1 + p2)), prior sigmoid(d) (= p1 / (p1 + p2), the two-way probability).
  Costs one top-2 pass over the vocabulary, about what the argmax costs.
* "top1": p1 = softmax top-1 probability, feature and prior both p1. Costs a
  log-sum-exp over the vocabulary.

Which predicts acceptance better is measured (scripts/adaptive_features.py);
`DEFAULT_FEATURE` holds the answer.
"""

from __future__ import annotations

import torch

FEATURES = ("margin", "top1")
DEFAULT_FEATURE = "margin"


def draft_confidence(logits: torch.Tensor, feature: str = DEFAULT_FEATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (feature [N], prior [N]), float32, on the logits' device."""
    if feature not in FEATURES:
        raise ValueError(f"confidence feature {feature!r}: choose one of {FEATURES}")
    x = logits.float()
    if feature == "margin":
        top = x.topk(2, dim=-1).values
        d = top[:, 0] - top[:, 1]
        return torch.tanh(d / 2), torch.sigmoid(d)
    p1 = torch.exp(x.max(dim=-1).values - torch.logsumexp(x, dim=-1))
    return p1, p1
