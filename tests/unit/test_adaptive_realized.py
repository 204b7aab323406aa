"""Realised against forecast cycle time (vllm_dflash.adaptive.realized): cost curves
that are wrong in a way their fits cannot see are corrected by how long the step
cycles took, per batch size and apart for drafting and not drafting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_dflash.adaptive.calibration import GREEDY
from vllm_dflash.adaptive.controller import OPTIMAL, PROBE, BudgetController, Plan
from vllm_dflash.adaptive.realized import ArmRates, RealizedRatio
from vllm_dflash.adaptive.speculation import AdaptiveSpeculation

K = 15


def test_ratio_is_recovered_per_kind_and_batch_size():
    r = RealizedRatio([1, 2, 4, 8, 16], memory=1e9, min_cycles=8)  # (no forgetting here)
    for _ in range(7):
        r.observe(8, True, forecast=0.1, seconds=0.2)  # twice as long as forecast
    assert r.factors(8) == (1.0, 1.0)  # not enough cycles yet
    r.observe(8, True, forecast=0.1, seconds=0.2)
    assert r.factors(8) == pytest.approx((1.0, 2.0))
    assert r.factors(7) == pytest.approx((1.0, 2.0))  # nearest knot
    assert r.factors(16) == (1.0, 1.0) and r.factors(4) == (1.0, 1.0)
    for _ in range(8):
        r.observe(8, False, forecast=0.1, seconds=0.08)
    assert r.factors(8) == pytest.approx((0.8, 2.0))


def test_a_kind_that_stops_running_loses_its_factor():
    """Drafting measured 2x its forecast, then only no-draft cycles run (the plan that
    factor produced): the drafting factor fades back to 1 (trust the curves, try again)
    within memory * stale_factor * ln(weight / min_cycles) no-draft cycles, not never."""
    r = RealizedRatio([1], memory=32, min_cycles=4, stale_factor=4)
    for _ in range(32):
        r.observe(1, True, forecast=0.1, seconds=0.2)
    assert r.factors(1)[1] == pytest.approx(2.0)
    weight = r.weight[0, 1]
    fades_after = math.ceil(32 * 4 * math.log(weight / 4)) + 1
    for _ in range(fades_after - 10):
        r.observe(1, False, forecast=0.1, seconds=0.1)
    assert r.factors(1)[1] == pytest.approx(2.0)  # still held: it fades slowly
    for _ in range(10):
        r.observe(1, False, forecast=0.1, seconds=0.1)
    assert r.factors(1) == (pytest.approx(1.0), 1.0)


def test_ratio_forgets_and_clips():
    r = RealizedRatio([1], memory=8, min_cycles=2, clip=4.0)
    for _ in range(40):
        r.observe(1, True, forecast=0.01, seconds=1.0)  # 100x: clipped to 4x
    assert r.factors(1)[1] == pytest.approx(4.0)
    for _ in range(80):  # the machine changed: now as forecast
        r.observe(1, True, forecast=1.0, seconds=1.0)
    assert r.factors(1)[1] == pytest.approx(1.0, abs=0.01)
    r.observe(1, True, forecast=0.0, seconds=1.0)  # no forecast: ignored
    assert math.isfinite(r.log_sum.sum()) and r.factors(1)[1] == pytest.approx(1.0, abs=0.01)


def _controller_drafting_at_8(slope: float = 0.05, **kwargs) -> tuple[BudgetController, list[str], np.ndarray]:
    """A controller past warm-up whose fitted curves say drafting pays for 8 greedy
    requests at acceptance 0.6 per position (a little; by about 13% with `slope` 0.3,
    each verified token costing 30% of a decode step)."""
    c = BudgetController(K, 64, seed=0, max_explore_probability=0.0, **kwargs)
    for t in range(1, K + 2):
        for _ in range(3):
            c.step_cost.observe(8, t, 1e-3 * (1 + slope * (t - 1)))
            c.draft_cost.observe(8, t, 2e-4 * t)
    c._warmup_done[c._warmup_key(8)] = c.warmup_steps
    c._warmup_total += c.warmup_steps
    c._no_draft_seen.add(c._warmup_key(8))  # as if measured: no first run without drafts
    c._draft_seen.add(c._warmup_key(8))  # nor a first drafting run
    ids = [f"r{i}" for i in range(8)]
    c.prior.record(ids, np.full(8, GREEDY), np.tile(np.cumprod(np.full(K, 0.6)), (8, 1)))
    return c, ids, np.full(8, GREEDY)


def test_drafting_slower_than_forecast_is_planned_away():
    """Drafting cycles took 1.6x their forecast, no-draft cycles their forecast: the
    plan becomes no draft."""
    c, ids, kinds = _controller_drafting_at_8(refresh_steps=1)
    first = c.plan(ids, kinds)
    assert first.q > 0 and first.reason == OPTIMAL
    forecast = c.forecast_seconds(8, first.q, 8)
    assert forecast == pytest.approx(c.step_cost.predict(8, [2.0])[0] + c.draft_cost.predict(8, [first.q + 1.0])[0])
    for _ in range(10):
        c.realized.observe(8, True, forecast, 1.6 * forecast)
        c.realized.observe(8, False, 1e-3, 1e-3)
    assert c.plan(ids, kinds).q == 0


def test_a_plan_is_redone_as_soon_as_its_time_factor_moves():
    """With the default refresh interval (16 decisions) a wrong plan at a new batch size
    used to run until the refresh; once the drafting cycles' realised/forecast factor
    moves by more than 10% the plan is redone at the next decision."""
    c, ids, kinds = _controller_drafting_at_8()
    assert c.refresh_steps > 8
    first = c.plan(ids, kinds)
    assert first.q > 0
    forecast = c.forecast_seconds(8, first.q, 8)
    for _ in range(5):  # min_cycles of (forgetting) evidence, 1.6x slower than forecast
        c.realized.observe(8, True, forecast, 1.6 * forecast)
        c.realized.observe(8, False, 1e-3, 1e-3)
    assert c.plan(ids, kinds).q == 0  # the second decision: long before a refresh
    assert not BudgetController._factors_moved((1.0, 1.0), (1.05, 0.95))


def test_speculation_reports_each_steady_cycle_against_its_forecast():
    """Cycle = the call's drafting + the next step outside drafting, against the curves'
    forecast for the q and budgets it ran."""
    spec = AdaptiveSpeculation(K, 8, warmup_steps=0, knot_warmup_steps=0, measure_first_calls=True)
    c = spec.controller
    c.step_cost.observe(2, 1.0, 4e-3)
    c.draft_cost.observe(2, 1.0, 1e-3)
    plan = spec.begin(0.0, ["a", "b"], np.array([0, 0]), np.array([0, 0]), 2, np.ones(2, bool), np.ones(2, bool))
    assert plan.q == 0 and plan.reason == OPTIMAL
    spec.choose(0.001, np.zeros((2, 0)), np.zeros((2, 0)))
    spec.end(0.002)  # drafting 2 ms, q = 0
    spec.begin(0.010, ["a", "b"], np.array([0, 0]), np.array([0, 0]), 2, np.ones(2, bool), np.ones(2, bool))
    key = c.realized.key(2)
    assert c.realized.weight[key].tolist() == [1.0, 0.0]  # one no-draft cycle
    # 2 ms drafting + 8 ms outside, against the 1 ms + 4 ms forecast, in the curves' units: the
    # step took twice its prediction, which the speed index takes in part as the machine's speed
    assert spec.speed.factor > 1.0
    assert c.realized.log_sum[key, 0] == pytest.approx(math.log((2e-3 + 8e-3 / spec.speed.factor) / 5e-3))


def _drafting_speculation(**kwargs):
    """AdaptiveSpeculation over `_controller_drafting_at_8`, its first plan begun."""
    spec = AdaptiveSpeculation(K, 64, seed=0, max_explore_probability=0.0, measure_first_calls=True, **kwargs)
    c, ids, kinds = _controller_drafting_at_8()
    spec.controller = c
    none = np.zeros(8, dtype=np.int64)
    plan = spec.begin(0.0, ids, none, none, 8, np.ones(8, bool), np.ones(8, bool))
    assert plan.q > 0 and plan.reason == OPTIMAL
    return spec, c, ids


def test_a_cycle_whose_step_carried_a_prompt_is_still_measured():
    """Once speculation puts in-flight requests out of step, most steps at many requests
    carry a new request's prompt. Such a cycle is held to the plan plus the prompt's
    tokens priced like verified drafts; before, it was never measured, and drafting
    that lost went on as long as prompts kept coming."""
    spec, c, ids = _drafting_speculation()
    q = spec._step.plan.q
    feature = np.full((8, q), 0.9)
    budgets = spec.choose(1e-4, feature, feature)
    draft_s, step_s = c.forecast_parts(8, q, int(budgets.sum()))
    expected_tokens = 8 + spec._step.expected_accepted
    spec.end(1e-4)
    budget, prompt = int(budgets.sum()), 40
    extra = c.step_seconds(8, 8 + budget + prompt) - c.step_seconds(8, 8 + budget)
    assert extra > 0
    outside = 2 * (step_s + extra)
    accepted = budgets.copy()  # every draft accepted
    spec.begin(1e-4 + outside, ids, budgets, accepted, 8 + budget + prompt, np.ones(8, bool), np.ones(8, bool))
    key = c.realized.key(8)
    assert c.realized.weight[key, 1] == 1.0
    assert c.realized.log_sum[key, 1] == pytest.approx(math.log((1e-4 + outside) / (draft_s + step_s + extra)),
                                                       rel=1e-6)
    assert c.realized.yields[key, 1].tolist() == pytest.approx([expected_tokens, 8 + budget], rel=1e-9)
    assert c.step_cost.observations == 3 * (K + 1)  # the curves themselves learn from plain steps only


def test_speed_index_follows_a_uniform_change_of_speed_and_keeps_the_curves():
    """The machine slows 1.5x for a while, then returns: samples enter the curves in the
    units of a steady machine, so the no-draft curve stays where it was, the index
    carries the change, and no decision compares a slow sample with a fast one."""
    from vllm_dflash.adaptive.realized import SpeedIndex

    index = SpeedIndex(memory=8, prior=0)
    for _ in range(40):
        index.observe(1.5e-3, 1e-3)
    assert index.factor == pytest.approx(1.5)
    for _ in range(80):
        index.observe(1e-3, 1e-3)
    assert index.factor == pytest.approx(1.0, abs=0.01)
    index.observe(0.0, 1e-3)  # nothing to compare: ignored
    index.observe(1e-3, 0.0)
    assert index.factor == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="memory >= 1"):
        SpeedIndex(memory=0.5)

    spec, c, ids = _drafting_speculation()
    none = np.zeros(8, dtype=np.int64)
    before = c.step_cost.predict(8, [1.0])[0]
    now = 0.0
    for slow in [1.5] * 60 + [1.0] * 60:  # plain decode steps, each `slow` x the curve's no-draft step
        spec._step = None
        spec._handed = None
        spec._prev_end = now
        spec._prev_req_list, spec._prev_req_ids = ids, set(ids)
        now += slow * before
        spec._learn_and_sample(now, 8, 8, steady=True)
        if slow == 1.5:
            during = spec.speed.factor
    assert during > 1.3  # the index carried the slow stretch
    assert c.step_cost.predict(8, [1.0])[0] == pytest.approx(before, rel=0.1)  # the curve did not


def test_drafts_yielding_fewer_tokens_than_expected_count_as_slower():
    """A drafting cycle on time that yields half the tokens its budgets expected costs
    twice the seconds per token: factor 2 (time and yield multiply); a no-draft cycle
    yields what it expects."""
    r = RealizedRatio([1, 2, 4, 8], memory=1e9, min_cycles=4)
    for _ in range(4):
        r.observe(8, True, forecast=0.1, seconds=0.1, expected_tokens=24.0, tokens=12.0)
        r.observe(8, False, forecast=0.1, seconds=0.1, expected_tokens=8.0, tokens=8.0)
    assert r.factors(8) == pytest.approx((1.0, 2.0))
    for _ in range(4):
        r.observe(4, True, forecast=0.1, seconds=0.15, expected_tokens=8.0, tokens=12.0)
    assert r.factors(4)[1] == pytest.approx(1.0)  # 1.5x the time, 1.5x the tokens


def test_noisy_yields_that_meet_their_expectation_cost_nothing():
    """Drafting cycles on time whose tokens are as expected on average but vary from cycle
    to cycle (one request: 1 + a geometric count of accepted drafts, capped at 15, as on the
    bundled pair). The yield factor is expected over yielded tokens summed over the cycles:
    within 5% of 1 over 4000 cycles. The mean of per-cycle log ratios (the rule before) put it
    at 1.2-1.4 (Jensen's inequality): drafting priced dearer for drafts that were exact."""
    rng = np.random.default_rng(0)
    accept = 0.7
    mean_tokens = 1.0 + sum(accept ** j for j in range(1, 16))
    r = RealizedRatio([1], memory=1e9, min_cycles=4)
    logs = []
    for _ in range(4000):
        tokens = 1.0 + min(rng.geometric(1.0 - accept) - 1, 15)
        r.observe(1, True, forecast=0.01, seconds=0.01, expected_tokens=mean_tokens, tokens=tokens)
        logs.append(math.log(mean_tokens / tokens))
    assert r.factors(1)[1] == pytest.approx(1.0, abs=0.05)
    assert math.exp(np.mean(logs)) > 1.15  # what the mean log ratio said


def test_a_plan_whose_drafts_yield_less_than_promised_is_planned_away():
    """Drafting cycles on time, but each yielded only the bonus tokens (nothing accepted)
    where the budgets expected more: the plan becomes no draft."""
    spec = AdaptiveSpeculation(K, 64, seed=0, max_explore_probability=0.0, refresh_steps=1)
    c, ids, kinds = _controller_drafting_at_8(refresh_steps=1)
    spec.controller = c
    greedy, everyone = np.ones(8, bool), np.ones(8, bool)
    none = np.zeros(8, dtype=np.int64)
    now, drafted = 0.0, 0
    spec.begin(now, ids, none, none, 8, greedy, everyone)
    for _ in range(12):
        st = spec._step
        q = st.plan.q
        feature = np.full((8, q), 5.0)  # confident drafts: high expected acceptance
        budgets = spec.choose(now + 1e-4, feature, np.full((8, q), 0.9)) if q else spec.choose(
            now + 1e-4, np.zeros((8, 0)), np.zeros((8, 0)))
        drafted += q > 0
        draft_s, step_s = c.forecast_parts(8, q, int(budgets.sum()))
        spec.end(now + draft_s)
        now += draft_s + step_s  # every cycle takes exactly its forecast, drafting and step alike
        spec.begin(now, ids, budgets, none, 8 + int(budgets.sum()), greedy, everyone)  # nothing accepted
    assert drafted >= 4 and spec._step.plan.q == 0
    assert c.realized.factors(8)[1] > 1.3  # on time, so from the yield alone


# ------------------------------------------------------------ measured arms --


def _cycles(arms: ArmRates, rng, n: int, draft_every: int, draft_rate: float, no_draft_rate: float,
            noise: float = 0.15, requests: int = 8) -> None:
    """n cycles at `requests`, one in `draft_every` drafting; log-normal noise on each cycle's seconds."""
    for i in range(n):
        drafted = i % draft_every == 0
        tokens = 17.3 if drafted else 8.0
        rate = draft_rate if drafted else no_draft_rate
        arms.observe(requests, drafted, tokens / rate * math.exp(rng.normal(0.0, noise)), tokens)


def test_arms_tell_a_drafting_loss_only_beyond_their_noise():
    """Drafting 20% fewer tokens per second than not drafting (the traced 8-request float32
    cell), 15% noise per cycle: no verdict before min_cycles of each arm, then -1; with equal
    rates, drafting is found ahead at the end of a run in at most 6% of 100 seeds (z = 2:
    about 2.3% expected; the bound leaves room for the noise floor and forgetting) and behind
    in at most 25% (stop_z = 1: about 16%; equal rates make either choice right);
    the loss is found in at least 95 of the 100."""
    arms = ArmRates([1, 2, 4, 8, 16])
    assert arms.verdict(8) == 0 and arms.rates(8) == (0.0, 0.0)
    rng = np.random.default_rng(0)
    _cycles(arms, rng, 4 * 5, 4, 0.8, 1.0)  # 5 drafting cycles: too few
    assert arms.cycles(8, True) < arms.min_cycles and arms.verdict(8) == 0
    _cycles(arms, rng, 4 * 20, 4, 0.8, 1.0)
    assert arms.verdict(8) == -1 and arms.verdict(16) == 0  # per knot
    no_draft, drafting = arms.rates(8)
    assert drafting / no_draft == pytest.approx(0.8, rel=0.1)
    wrong = stopped = found = 0
    for seed in range(100):
        equal, lossy = ArmRates([1, 8]), ArmRates([1, 8])
        _cycles(equal, np.random.default_rng(seed), 200, 4, 1.0, 1.0)
        _cycles(lossy, np.random.default_rng(1000 + seed), 200, 4, 0.8, 1.0)
        wrong += equal.verdict(8) == 1
        stopped += equal.verdict(8) == -1
        found += lossy.verdict(8) == -1
    assert wrong <= 6 and stopped <= 25 and found >= 95, (wrong, stopped, found)
    gain = ArmRates([8])
    _cycles(gain, np.random.default_rng(3), 200, 2, 1.5, 1.0)
    assert gain.verdict(8) == 1


def _lapse(draft_rate: float, seed: int = 0) -> tuple[int, int]:
    """(no-draft cycles after a verdict of -1 until it goes back to 0, the cycles until the
    drafting arm's faded weight falls below min_cycles) at 8 requests, 100 drafting cycles."""
    arms = ArmRates([8], memory=32, min_cycles=6, stale_factor=4)
    _cycles(arms, np.random.default_rng(seed), 200, 2, draft_rate, 1.0)
    assert arms.verdict(8) == -1
    below = math.ceil(32 * 4 * math.log(arms.cycles(8, True) / 6)) + 1
    for i in range(20000):
        if arms.verdict(8) == 0:
            return i, below
        arms.observe(8, False, 8.0, 8.0)  # at the no-draft arm's own rate
    raise AssertionError("the verdict never lapsed")


def test_an_arm_that_stops_running_loses_its_verdict_as_its_evidence_ages():
    """Only no-draft cycles after a verdict: the drafting arm's evidence fades (its weight
    widens the standard error), and the verdict goes back to 0 (the controller then
    probes again), a clear one later than a marginal one, and later than the moment the
    faded weight falls below min_cycles (that gate had dropped every verdict there)."""
    clear, below = _lapse(0.6)
    marginal, _ = _lapse(0.85)
    assert below < marginal < clear < 20000, (below, marginal, clear)
    # A text change (`discount`, keep 10%) drops the measured cycles too: no verdict at once.
    arms = ArmRates([8])
    _cycles(arms, np.random.default_rng(0), 200, 2, 0.6, 1.0)
    assert arms.verdict(8) == -1
    arms.discount(8, 0.1)
    assert arms.verdict(8) == 0


def test_the_burden_of_proof_is_on_drafting():
    """One standard error behind stops drafting, two ahead are needed to start it: at
    5% fewer tokens per second drafting (noise 15% a cycle, 40 cycles of each arm) the
    verdict is -1 in most of 100 seeds; at 5% more it is +1 in few of them, and -1 in
    fewer still; with equal rates, +1 comes out in at most 6 of 100 (z = 2: ~2.3% one-sided)."""
    def verdicts(rate: float) -> list[int]:
        out = []
        for seed in range(100):
            arms = ArmRates([8])
            _cycles(arms, np.random.default_rng(seed), 80, 2, rate, 1.0)
            out.append(arms.verdict(8))
        return out
    behind, ahead, equal = verdicts(0.95), verdicts(1.05), verdicts(1.0)
    assert behind.count(-1) >= 55, behind.count(-1)
    assert ahead.count(1) <= 70 and ahead.count(-1) <= 10, (ahead.count(1), ahead.count(-1))
    assert equal.count(1) <= 6, equal.count(1)


def test_close_curves_probe_the_other_arm_and_the_measured_arms_decide():
    """The curves say drafting pays a little at 8 requests (within probe_margin): about
    probe_probability of the decisions do not draft, reason PROBE (a drafting probe would
    keep the plan's budgets: no random extras). Measured cycles then show drafting
    delivering 20% fewer tokens per second: the plan is no draft, whatever the curves say,
    and probing stops while the verdict holds. A plan of no draft is never probed."""
    c, ids, kinds = _controller_drafting_at_8(slope=0.3)
    first = c.plan(ids, kinds)
    assert first.q > 0 and first.reason == OPTIMAL
    entry = c._cache[8]
    assert entry.probe and entry.other_q == 0 and entry.verdict == 0
    reasons = [c.plan(ids, kinds) for _ in range(800)]
    probes = [p for p in reasons if p.reason == PROBE]
    assert all(p.q == 0 for p in probes)
    assert len(probes) / len(reasons) == pytest.approx(c.probe_probability, abs=0.03)
    # in runs of probe_steps steps without drafts: a lone no-draft cycle among drafting ones measures nothing
    runs = "".join("p" if p.reason == PROBE else "." for p in reasons).split(".")
    lengths = [len(r) for r in runs if r]
    assert lengths and all(n % c.probe_steps == 0 for n in lengths[:-1]), lengths
    survival = np.tile(np.cumprod(np.full(first.q, 0.6)), (8, 1))
    optimal = c.budgets(Plan(first.q, OPTIMAL), survival, 1e-3)
    assert np.array_equal(c.budgets(Plan(first.q, PROBE), survival, 1e-3), optimal)
    rng = np.random.default_rng(0)
    _cycles(c.arms, rng, 120, 2, 0.8, 1.0)
    assert c.arms.verdict(8) == -1
    after = [c.plan(ids, kinds) for _ in range(200)]
    assert all(p.q == 0 for p in after if p.reason == OPTIMAL)
    assert not any(p.reason == PROBE for p in after)  # and a plan of no draft is never probed:
    c.arms = ArmRates(c._knots)  # (forgotten: no verdict) curves that put not drafting a little ahead
    c.step_cost = type(c.step_cost)(K + 1, 64)
    for t in range(1, K + 2):
        for _ in range(3):
            c.step_cost.observe(8, t, 1e-3 * (1 + 0.6 * (t - 1)))
    c._cache.clear()
    plans = [c.plan(ids, kinds) for _ in range(300)]
    assert all(p.q == 0 and p.reason == OPTIMAL for p in plans) and not c._cache[8].probe


def test_curves_far_apart_do_not_probe():
    """Where the curves see drafting far ahead (free verification, high acceptance), no
    decision is spent on the no-draft arm; a measured verdict still applies when it exists."""
    c = BudgetController(K, 64, seed=0, max_explore_probability=0.0)
    for t in range(1, K + 2):
        for _ in range(3):
            c.step_cost.observe(1, t, 1e-3)
            c.draft_cost.observe(1, t, 1e-4)
    c._warmup_done[c._warmup_key(1)] = c.warmup_steps
    c._warmup_total += c.warmup_steps
    c._no_draft_seen.add(c._warmup_key(1))  # as if measured: no first run without drafts
    c._draft_seen.add(c._warmup_key(1))  # nor a first drafting run
    c.prior.record(["a"], np.full(1, GREEDY), np.cumprod(np.full(K, 0.9))[None, :])
    plans = [c.plan(["a"], np.full(1, GREEDY)) for _ in range(300)]
    assert all(p.reason == OPTIMAL and p.q > 0 for p in plans)
    assert not c._cache[1].probe


@pytest.mark.parametrize("no_draft_value", [0.0, np.inf, -1.0])
def test_a_degenerate_no_draft_value_plans_without_a_probe(no_draft_value, monkeypatch):
    """The probe compares drafting with not drafting on the log of a ratio of values; a
    value of 0, inf or below 0 (a degenerate curve) had raised `math domain error` in a
    serving step under load and killed the engine. Now it plans, and does not probe."""
    c, ids, kinds = _controller_drafting_at_8(refresh_steps=1)
    plan_values = c.plan_values

    def degenerate(*args, **kwargs):
        values, seconds, full, verifies = plan_values(*args, **kwargs)
        values = values.copy()
        values[0] = no_draft_value
        return values, seconds, full, verifies

    monkeypatch.setattr(c, "plan_values", degenerate)
    plan = c.plan(ids, kinds)
    assert plan.reason == OPTIMAL and not c._cache[8].probe


def test_the_first_call_of_a_block_shape_is_no_sample():
    """The first cycle at a (requests, q) shape pays one-off costs (the draft's kernels for a
    new shape): it feeds neither D, nor the realised factors, nor the arms; the next cycle of
    the same shape does."""
    spec = AdaptiveSpeculation(K, 8, warmup_steps=0, knot_warmup_steps=0)
    c = spec.controller
    c.step_cost.observe(2, 1.0, 4e-3)
    c.draft_cost.observe(2, 1.0, 1e-3)
    key = c.realized.key(2)
    drafts_seen = c.draft_cost.observations

    def begin(t0: float) -> None:
        plan = spec.begin(t0, ["a", "b"], np.array([0, 0]), np.array([0, 0]), 2, np.ones(2, bool), np.ones(2, bool))
        assert plan.q == 0

    def finish(t0: float) -> None:
        spec.choose(t0 + 0.001, np.zeros((2, 0)), np.zeros((2, 0)))
        spec.end(t0 + 0.020)  # 20 ms of drafting: a first call's cost

    begin(0.0)
    finish(0.0)
    begin(0.030)  # closes the first cycle
    assert c.draft_cost.observations == drafts_seen  # the first call: no D sample
    assert c.realized.weight[key].tolist() == [0.0, 0.0] and c.arms.cycles(2, False) == 0.0
    finish(0.030)
    assert c.draft_cost.observations == drafts_seen + 1  # the second call of the shape is one
    begin(0.060)
    assert c.realized.weight[key].tolist() == [1.0, 0.0] and c.arms.cycles(2, False) == 1.0


def test_new_text_discounts_the_arms_and_the_yield_but_not_the_time():
    """The arms said drafting loses (-1) and drafting cycles yielded half the tokens expected
    (factor 2, on time) for one batch of requests. A step whose requests are all new (new
    text) keeps NEW_TEXT_KEEP of that evidence: the verdict is open again (0) and the yield
    factor waits for cycles of the new requests, while the time ratios (the machine's) stay.
    A step that keeps one of the old requests discounts nothing."""
    from vllm_dflash.adaptive.realized import NEW_TEXT_KEEP

    def measured(spec):
        c = spec.controller
        for i in range(40):
            c.arms.observe(1, i % 2 == 0, 0.01, 4.0 if i % 2 == 0 else 8.0)  # drafting: half the rate
            c.realized.observe(1, True, forecast=0.01, seconds=0.012, expected_tokens=4.0, tokens=2.0)
        assert c.verdict(1) == -1 and c.time_factors(1)[1] == pytest.approx(2.4)

    def step(spec, now, ids):
        none = np.zeros(len(ids), dtype=np.int64)
        spec.begin(now, ids, none, none, 40, np.ones(len(ids), bool), np.ones(len(ids), bool))
        spec.choose(now + 1e-4, np.zeros((len(ids), 0)), np.zeros((len(ids), 0)))
        spec.end(now + 2e-4)

    spec = AdaptiveSpeculation(K, 8, seed=0)
    step(spec, 0.0, ["a"])
    measured(spec)
    step(spec, 1.0, ["a", "b"])  # a stays: the same text in part, nothing discounted
    assert spec.controller.verdict(1) == -1
    step(spec, 2.0, ["b"])
    measured(spec)
    c = spec.controller
    before = c.realized.yields[c.realized.key(1), 1]
    step(spec, 3.0, ["c"])  # only new requests: new text
    assert c.verdict(1) == 0 and c.arms.cycles(1, True) < c.arms.min_cycles
    assert c.time_factors(1)[1] == pytest.approx(1.2)  # the time ratio stays, the yield waits
    assert c.realized.yields[c.realized.key(1), 1] == pytest.approx(NEW_TEXT_KEEP * before, rel=0.05)
