"""The draft confidence features the acceptance model reads."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dflash.adaptive.confidence import argmax_with_confidence, draft_confidence, sampled_confidence


def test_margin_and_top1_on_known_logits():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    feature, prior = draft_confidence(logits, "margin")
    assert feature.tolist() == pytest.approx([math.tanh(1.0), 0.0])  # tanh(d / 2), d = top1 - top2
    assert prior.tolist() == pytest.approx([1 / (1 + math.exp(-2.0)), 0.5])  # p1 / (p1 + p2)
    p1, prior = draft_confidence(logits, "top1")
    z = math.exp(2.0) + 1 + math.exp(-1.0)
    assert p1.tolist() == pytest.approx([math.exp(2.0) / z, math.exp(0.5) / (2 * math.exp(0.5) + 1)])
    assert torch.equal(p1, prior)
    with pytest.raises(ValueError, match="confidence feature 'entropy'"):
        draft_confidence(logits, "entropy")


@pytest.mark.parametrize("feature", ["margin", "top1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_argmax_matches_argmax_and_the_confidence(feature, dtype):
    """The drafts of the adaptive path are argmax's tokens, first index on ties
    included (bf16 logits tie often), with the same confidence as draft_confidence."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 500, generator=gen) * 3).to(dtype)
    logits[:16, 7] = logits[:16, 300] = logits[:16].float().max(dim=-1).values.to(dtype) + 1  # exact ties
    ids, (feat, prior) = argmax_with_confidence(logits, feature)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.float().argmax(dim=-1))
    assert (ids[:16] == 7).all()
    want_feat, want_prior = draft_confidence(logits, feature)
    assert torch.allclose(feat, want_feat) and torch.allclose(prior, want_prior)
    with pytest.raises(ValueError, match="confidence feature 'entropy'"):
        argmax_with_confidence(logits, "entropy")


def test_sampled_rows_are_scored_by_the_probability_of_the_drawn_token():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.25, 0.25]])
    drafts = torch.tensor([0, 1, 2])
    conf = (torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.95, 0.9, 0.85]))
    feature, prior = sampled_confidence(conf, probs, drafts, torch.tensor([False, True, True]))
    assert feature.tolist() == pytest.approx([0.9, 0.3, 0.25]) and prior.tolist() == pytest.approx([0.95, 0.3, 0.25])
