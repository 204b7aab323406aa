"""PolicyEpochs: epochs with speculation off against the controller's, on synthetic rates.

Each simulated step yields `requests` tokens at the policy's rate times log-normal
noise (sd 0.2 a step: ~0.035 an epoch of 32 steps, wider than the engine's epochs
at 8+ requests were traced). Shares are asserted over 400 epochs after the verdict
settles: a binomial share of p over 400 draws has sd <= 0.025, and each bound is
more than 3 sd from its expectation."""

import math

import numpy as np
import pytest

from vllm_dflash.adaptive.controller import OFF_EPOCH, BudgetController
from vllm_dflash.adaptive.epochs import ADAPTIVE, OFF, PolicyEpochs


def simulate(epochs: PolicyEpochs, rates: dict[int, float], steps: int, requests: int = 8,
             drafting: bool = True, seed: int = 1) -> list[int]:
    """Run `steps` steps; the policy of each epoch closed, in order."""
    noise = np.random.default_rng(seed)
    closed = []
    for _ in range(steps):
        policy = epochs.policy(requests)
        seconds = requests / rates[policy] * math.exp(noise.normal(0.0, 0.2))
        before = list(epochs.epochs_closed)
        epochs.step(requests, drafting and policy == ADAPTIVE, seconds, requests)
        if epochs.epochs_closed != before:
            closed.append(policy)
    return closed


def test_off_wins_where_drafting_loses_end_to_end():
    epochs = PolicyEpochs(np.random.default_rng(0))
    closed = simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1150.0}, 32 * 600)
    assert epochs.verdict(8) == -1
    late = closed[-400:]
    assert 0.80 <= late.count(OFF) / len(late) <= 0.95  # 1 - retest_share = 0.875
    a, off = epochs.rates(8)
    assert off / a == pytest.approx(1.15, rel=0.03)


def test_adaptive_wins_where_drafting_pays():
    epochs = PolicyEpochs(np.random.default_rng(0))
    closed = simulate(epochs, {ADAPTIVE: 1600.0, OFF: 1000.0}, 32 * 600)
    assert epochs.verdict(8) == 1
    late = closed[-400:]
    assert late.count(OFF) / len(late) <= 0.08  # confirmed_share = 1/32
    assert late.count(OFF) >= 1  # still measured now and then


def test_undecided_runs_trials_at_their_share():
    epochs = PolicyEpochs(np.random.default_rng(0))
    closed = simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1000.0}, 32 * 40)  # equal: mostly undecided
    assert 0.1 <= closed.count(OFF) / len(closed) <= 0.5  # trial_share = 0.25 (or a passing verdict)


def test_clear_cycle_advantage_skips_trials():
    """Before any verdict (48 epochs, fewer than min_epochs OFF ones with the advantage): OFF
    epochs at 1/32 (expected 1.5; P(>= 6) < 0.5%) against 1/4 without it (expected 12)."""
    counts = []
    for advantage in (1.6, 1.0):
        epochs = PolicyEpochs(np.random.default_rng(0))
        epochs.cycle_advantage = lambda requests, a=advantage: a
        counts.append(simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1000.0}, epochs.epoch_steps * 48).count(OFF))
    assert counts[0] <= 5 and counts[1] >= 6


def test_epoch_is_dropped_when_the_batch_changes_or_engine_idles():
    epochs = PolicyEpochs(np.random.default_rng(0), epoch_steps=8)
    for _ in range(7):
        epochs.step(8, True, 0.01, 8)
    epochs.step(7, True, 0.01, 7)  # a new size: the 8-request epoch is dropped, this cycle counts nowhere
    for _ in range(7):
        epochs.step(7, True, 0.01, 7)
    assert epochs.epochs_closed == [0, 0]
    epochs.step(7, True, 0.01, 7)
    assert sum(epochs.epochs_closed) == 1
    for _ in range(7):
        epochs.step(7, True, 0.01, 7)
    epochs.abort()
    epochs.step(7, True, 0.01, 7)
    assert sum(epochs.epochs_closed) == 1


def test_adaptive_epoch_without_drafting_is_no_sample():
    epochs = PolicyEpochs(np.random.default_rng(0))
    simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1000.0}, 32 * 50, drafting=False)
    assert epochs.epochs_closed[ADAPTIVE] == 0 and epochs.rates(8)[0] == 0.0
    assert epochs.verdict(8) == 0


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="epoch_steps >= 2"):
        PolicyEpochs(np.random.default_rng(0), epoch_steps=1)
    with pytest.raises(ValueError, match="clear_advantage >= 1"):
        PolicyEpochs(np.random.default_rng(0), clear_advantage=0.5)


def test_controller_does_not_draft_in_an_off_epoch():
    controller = BudgetController(max_k=7, max_requests=16, warmup_steps=0)
    controller.in_warmup = lambda requests: False
    controller.epochs._open = lambda requests: (setattr(controller.epochs, "_requests", requests),
                                                setattr(controller.epochs, "_steps", 0),
                                                setattr(controller.epochs, "_policy", OFF),
                                                setattr(controller.epochs, "off_now", True))
    req_ids = [f"r{i}" for i in range(4)]
    plan = controller.plan(req_ids, np.zeros(4, dtype=np.int64))
    assert (plan.q, plan.reason) == (0, OFF_EPOCH)
    for _ in range(5):
        controller.epochs.step(4, False, 0.01, 4)
    # A coasting run may cover the rest of the epoch and no more (its first step counts the cycle
    # planned before it, its last plan's cycle is counted after it: epoch_steps - 5 - 1 plans);
    # a drafting run none of it.
    assert controller.steady_run(req_ids, most=64) == (controller.epochs.epoch_steps - 6, 0)
    assert controller.steady_run(req_ids, most=64, drafting=True) == (0, 0)


def undecided_off_share(rate_a: float, adaptive_epochs: float, off_epochs: float, draws: int = 800) -> float:
    """The share of `draws` epochs opened OFF at 8 requests with the verdict forced to 0, ADAPTIVE's
    epochs all at `rate_a` tok/s and OFF's at 1000."""
    epochs = PolicyEpochs(np.random.default_rng(0), epoch_steps=2)
    epochs._sums[8] = [[n, n * math.log(rate), n * math.log(rate) ** 2]
                       for n, rate in ((adaptive_epochs, rate_a), (off_epochs, 1000.0))]
    epochs.verdict = lambda requests: 0
    drawn = []
    for _ in range(draws):
        epochs._open(8)
        drawn.append(epochs._policy)
    return drawn.count(OFF) / len(drawn)


def test_trials_follow_the_measured_lead_while_undecided():
    """Undecided (the verdict forced to 0): OFF epochs at 1/4 while OFF is unmeasured, 1/2 while
    OFF's rate leads, 1/8 while ADAPTIVE's leads by under `clear_advantage`, 1/32 beyond it.
    800 draws each: the shares' binomial sds are 0.015, 0.018, 0.012 and 0.006; every bound is
    over 3 sds from its share."""
    shares = [undecided_off_share(rate_a, 16.0, off_epochs)
              for rate_a, off_epochs in ((1000.0, 0.0), (900.0, 16.0), (1100.0, 16.0), (1500.0, 16.0))]
    assert 0.20 <= shares[0] <= 0.30
    assert 0.44 <= shares[1] <= 0.56
    assert 0.085 <= shares[2] <= 0.165
    assert shares[3] <= 0.06


def test_one_off_epoch_confirms_a_clear_lead():
    """OFF's rate does not follow the text, so one OFF epoch is enough to confirm a clear lead of
    ADAPTIVE's (`min_epochs` of them, over `clear_advantage` ahead): OFF at `confirmed_share` (1/32).
    Under the clear advantage, or with ADAPTIVE short of `min_epochs`, one OFF epoch is not a
    measured rate: OFF stays at `trial_share` (1/4). 800 draws each: sds 0.006 and 0.015, every
    bound over 3 sds from its share."""
    shares = [undecided_off_share(rate_a, adaptive_epochs, 1.0)
              for rate_a, adaptive_epochs in ((1500.0, 16.0), (1100.0, 16.0), (1500.0, 2.0))]
    assert shares[0] <= 0.06
    assert 0.20 <= shares[1] <= 0.30
    assert 0.20 <= shares[2] <= 0.30


def test_prompt_steps_count_in_the_epoch_but_not_in_its_rate():
    """An epoch of 12 plain steps at 1000 tok/s and 4 prompt steps ten times as long closes
    after its 16 steps at exactly 1000 tok/s (with the prompt steps in its rate: 128 tokens in 0.416 s, 308)."""
    traced = []
    epochs = PolicyEpochs(np.random.default_rng(0), epoch_steps=16)
    epochs.trace = traced.append
    epochs.policy(8)
    for i in range(16):
        prompt = i % 4 == 3
        epochs.step(8, True, 0.08 if prompt else 0.008, 8, plain=not prompt)
    assert len(traced) == 1 and traced[0]["tok_s"] == pytest.approx(1000.0)


def test_off_leads_once_both_policies_are_measured_and_off_ran_faster():
    """OFF 10% faster: no lead before `min_epochs` epochs of each policy, then a lead (its log-rate
    difference, ~0.095, is ~4 sds of two means of 3+ epochs at ~0.05 an epoch); ADAPTIVE 10% faster:
    none. The flag is what the rates say, as each epoch closes."""
    for rates, leads in (({ADAPTIVE: 1000.0, OFF: 1100.0}, True), ({ADAPTIVE: 1100.0, OFF: 1000.0}, False)):
        epochs = PolicyEpochs(np.random.default_rng(0))
        assert not epochs.off_leads(8)
        seen_unmeasured = False
        for _ in range(60):
            simulate(epochs, rates, epochs.epoch_steps, seed=len(epochs._sums) + sum(epochs.epochs_closed))
            if min(epochs.epochs_closed) < epochs.min_epochs:
                seen_unmeasured = True
                assert not epochs.off_leads(8)
        a, off = epochs.rates(8)
        assert seen_unmeasured and min(epochs.epochs_closed) >= epochs.min_epochs
        assert epochs.off_leads(8) == leads == (off > a)
        assert not epochs.off_leads(4)  # per batch size
