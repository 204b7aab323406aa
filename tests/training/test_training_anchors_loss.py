"""Anchor sampling bounds and coverage; DFlash's position-weighted loss."""

import math

import pytest
import torch

from vllm_dflash.training.anchors import anchor_range, sample_anchors
from vllm_dflash.training.loss import block_labels, block_loss, default_gamma, position_weights


def test_random_anchors_stay_in_the_response_and_leave_room_for_the_block():
    gen = torch.Generator().manual_seed(0)
    B = 16
    for trial in range(300):
        prompt_lens = torch.randint(1, 60, (4,), generator=gen).tolist()
        seq_lens = [p + int(torch.randint(B, 200, (1,), generator=gen)) for p in prompt_lens]
        anchors, keep = sample_anchors(prompt_lens, seq_lens, B, 8, "random", gen)
        for row in range(4):
            a = anchors[row][keep[row]].tolist()
            low, high = prompt_lens[row], seq_lens[row] - B
            assert len(a) == min(8, high - low + 1)
            assert a == sorted(set(a))                       # distinct, sorted
            assert all(low <= x <= high for x in a)          # in the response; a + B - 1 < seq_len
            assert not keep[row, len(a):].any() and (anchors[row, len(a):] == 0).all()


def test_random_anchors_cover_every_valid_position():
    # 20 candidates, 4 drawn per step: P(a given position is never drawn in 500 steps) = 0.8^500 < 1e-48.
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(500):
        anchors, _ = sample_anchors([10], [10 + 19 + 8], 8, 4, "random", gen)
        seen.update(anchors[0].tolist())
    assert seen == set(range(10, 30))


def test_fixed_anchors_tile_the_response():
    anchors, keep = sample_anchors([5, 7], [5 + 4 * 8, 7 + 20], 8, 10, "fixed")
    assert anchors[0].tolist() == [5, 13, 21, 29] and keep[0].all()
    assert anchors[1][keep[1]].tolist() == [7, 15] and keep[1].tolist() == [True, True, False, False]


def test_anchor_errors():
    assert anchor_range(0, 20, 8) == (1, 12)     # position 0 has no context before it
    with pytest.raises(ValueError, match="no room for a 16-token block"):
        sample_anchors([10], [20], 16, 4)
    with pytest.raises(ValueError, match="anchors='middle'"):
        sample_anchors([1], [40], 8, 4, "middle")


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7), rel_tol=1e-6)
    assert position_weights(4, None).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    with pytest.raises(ValueError, match="gamma > 0"):
        position_weights(16, 0.0)


def test_block_loss_by_hand():
    tokens = torch.tensor([[5, 6, 7, 8, 9, 1]])
    anchors = torch.tensor([[1, 2]])
    labels = block_labels(tokens, anchors, 3)
    assert labels.tolist() == [[[6, 7, 8], [7, 8, 9]]]
    V = 10
    logits = torch.zeros(1, 2, 2, V)
    logits[0, 0, 0, 7] = 5.0     # block 0 position 1: right
    logits[0, 0, 1, 3] = 5.0     # block 0 position 2: wrong
    logits[0, 1, 0, 2] = 5.0     # block 1 position 1: wrong
    logits[0, 1, 1, 9] = 5.0     # block 1 position 2: right
    keep = torch.tensor([[True, True]])
    w = position_weights(3, 2.0)
    loss, stats = block_loss(logits, labels, keep, w)
    lse = math.log(math.exp(5.0) + V - 1)
    right, wrong = lse - 5.0, lse
    expected = (1.0 * right + w[2].item() * wrong + 1.0 * wrong + w[2].item() * right) / (2 * (1 + w[2].item()))
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    assert stats["correct"].tolist() == [0, 1, 1] and stats["count"].tolist() == [0, 2, 2]
    assert stats["streak"].item() == 1      # block 0 accepts 1 draft, block 1 none
    # A padding block (keep=False) contributes nothing.
    loss2, stats2 = block_loss(logits, labels, torch.tensor([[True, False]]), w)
    assert math.isclose(loss2.item(), (right + w[2].item() * wrong) / (1 + w[2].item()), rel_tol=1e-5)
    assert stats2["count"].tolist() == [0, 1, 1]
