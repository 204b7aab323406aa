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
    """OFF 1.15x ahead: ADAPTIVE's epochs lose 13%, so retests run at retest_cost / 0.13 = 0.077
    of epochs (under retest_share, 1/8). Over the last 1600 epochs that share's binomial sd is
    0.0067: the bounds are 4 sds from it (1/8 is 7 sds above the upper one)."""
    epochs = PolicyEpochs(np.random.default_rng(0))
    closed = simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1150.0}, 16 * 2400)
    assert epochs.verdict(8) == -1
    late = closed[-1600:]
    assert 0.050 <= late.count(ADAPTIVE) / len(late) <= 0.104
    a, off = epochs.rates(8)
    assert off / a == pytest.approx(1.15, rel=0.03)


def test_the_verdict_holds_while_the_text_changes_both_rates():
    """Both policies' rates change by 1.8x every 200 steps (a new kind of text, a longer context),
    while ADAPTIVE runs 0.9x, then 1.15x, of OFF within each stretch. Compared with their
    neighbours the epochs give the true advantage and the verdict that goes with it. Within 7%:
    ~20 pairs once ADAPTIVE leads (OFF at 1/32), one in twelve across a change of stretch; over
    seeds 0-3 the estimates were off by 1-6% (by 5-19% as means over each policy's epochs)."""
    for truth, verdict in ((0.9, -1), (1.15, 1)):
        epochs = PolicyEpochs(np.random.default_rng(0))
        noise = np.random.default_rng(1)
        for step in range(16 * 500):
            speed = 1.8 if (step // 200) % 2 else 1.0
            policy = epochs.policy(8)
            rate = 1000.0 * speed * (truth if policy == ADAPTIVE else 1.0)
            epochs.step(8, policy == ADAPTIVE, 8 / rate * math.exp(noise.normal(0.0, 0.2)), 8)
        assert epochs.verdict(8) == verdict
        assert epochs.advantage(8) == pytest.approx(truth, rel=0.07)


def test_retests_cost_at_most_their_share_of_the_loss():
    """Once OFF leads, ADAPTIVE's share is retest_cost / loss between confirmed_share and
    retest_share: 1/8 for a 5% loss (1/8 x 5% is under 1%), 1/20 for 20%, 1/32 (the floor) for 50%."""
    epochs = PolicyEpochs(np.random.default_rng(0))
    shares = []
    for rate_a in (950.0, 800.0, 500.0):
        d = math.log(rate_a / 1000.0)
        epochs._pairs[8] = [8.0, 8 * d, 8 * d * d]
        shares.append(epochs.retest_share_at(8))
    assert shares == pytest.approx([1 / 8, 1 / 20, 1 / 32])


def test_an_epoch_goes_on_through_a_dip_of_one_request():
    """In flight, the batch dips by one request for a step when one finishes: the epoch keeps
    counting (8 -> 7 -> 8, and 4 -> 3), closes after its steps, and is kept under its size's key;
    a dip from 2 to 1 (half the batch) ends it."""
    epochs = PolicyEpochs(np.random.default_rng(0), epoch_steps=8, size_key=lambda r: 8 if r in (7, 8) else r)
    epochs.policy(8)
    for size in (8, 8, 7, 8, 8, 7, 8, 8):
        epochs.step(size, True, 0.01, size)
    assert sum(epochs.epochs_closed) == 1
    assert epochs.rates(7) == epochs.rates(8) and max(epochs.rates(8)) == pytest.approx(62 / 0.08)
    epochs.policy(4)
    for size in (4, 3, 4, 4, 4, 4, 3, 4):
        epochs.step(size, True, 0.01, size)
    assert sum(epochs.epochs_closed) == 2
    epochs.policy(2)
    for size in (2, 2, 2, 1, 2, 2, 2, 2, 2):
        epochs.step(size, True, 0.01, size)
    assert sum(epochs.epochs_closed) == 2  # the 1 ended the 2-request epoch at its 3rd step


def test_adaptive_wins_where_drafting_pays():
    epochs = PolicyEpochs(np.random.default_rng(0))
    closed = simulate(epochs, {ADAPTIVE: 1600.0, OFF: 1000.0}, 32 * 600)
    assert epochs.verdict(8) == 1
    late = closed[-400:]
    assert late.count(OFF) / len(late) <= 0.08  # confirmed_share = 1/32
    assert late.count(OFF) >= 1  # still measured now and then


def test_undecided_runs_trials_at_their_share():
    """Equal rates, and a verdict either way at 2 standard errors (at the default 1 for OFF, a
    chance dip of ADAPTIVE's pairs stops it, and rightly: no speculation is the safe side): OFF
    at trial_share 1/4, or 1/8 / 1/2 as the undecided pairs lean."""
    for seed in range(3):
        epochs = PolicyEpochs(np.random.default_rng(seed), stop_z=2.0)
        closed = simulate(epochs, {ADAPTIVE: 1000.0, OFF: 1000.0}, 32 * 40, seed=seed + 1)
        assert epochs.verdict(8) == 0
        assert 0.1 <= closed.count(OFF) / len(closed) <= 0.5


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
    epochs.step(5, True, 0.01, 5)  # over a quarter fewer: the 8-request epoch is dropped, this cycle counts nowhere
    for _ in range(7):
        epochs.step(5, True, 0.01, 5)
    assert epochs.epochs_closed == [0, 0]
    epochs.step(5, True, 0.01, 5)
    assert sum(epochs.epochs_closed) == 1
    for _ in range(7):
        epochs.step(5, True, 0.01, 5)
    epochs.abort()
    epochs.step(5, True, 0.01, 5)
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
    with pytest.raises(ValueError, match="retest_cost > 0"):
        PolicyEpochs(np.random.default_rng(0), retest_cost=0.0)
    with pytest.raises(ValueError, match=r"size_tolerance in \(0, 1\]"):
        PolicyEpochs(np.random.default_rng(0), size_tolerance=1.5)
    with pytest.raises(ValueError, match="pair_overlap >= 1"):
        PolicyEpochs(np.random.default_rng(0), pair_overlap=0.5)


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
    pairs, d = min(adaptive_epochs, 2 * off_epochs), math.log(rate_a / 1000.0)  # each OFF epoch between two
    epochs._pairs[8] = [pairs, pairs * d, pairs * d * d]
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
