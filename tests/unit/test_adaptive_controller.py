"""The budget controller on synthetic acceptance and cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_dflash.adaptive.calibration import GREEDY, SAMPLED
from vllm_dflash.adaptive.controller import (
    EXPLORE,
    LONGER_BLOCK_TOLERANCE,
    NO_DRAFT_REFRESH_FACTOR,
    OPTIMAL,
    PROBE,
    WARMUP,
    BudgetController,
    ForcedSchedule,
    Plan,
    best_budget,
)

K = 15


def controller(step_cost, draft_cost, requests=(1, 4, 16, 64), **kwargs) -> BudgetController:
    """A controller whose cost model has measured step_cost(R, t) and draft_cost(R, t) everywhere."""
    c = BudgetController(K, 64, seed=0, **kwargs)
    for r in requests:
        for t in range(1, K + 2):
            for _ in range(3):
                c.step_cost.observe(r, t, step_cost(r, t))
                c.draft_cost.observe(r, t, draft_cost(r, t))
        c._warmup_done[c._warmup_key(r)] = c.warmup_steps
        c._warmup_total += c.warmup_steps
        c._no_draft_seen.add(c._warmup_key(r))  # as if measured: no first run without drafts
        c._draft_seen.add(c._warmup_key(r))  # nor a first drafting run
    return c


def give_history(c: BudgetController, req_ids, survival_row) -> None:
    kinds = np.full(len(req_ids), GREEDY)
    c.prior.record(list(req_ids), kinds, np.tile(survival_row, (len(req_ids), 1)))


def high_survival() -> np.ndarray:
    return np.cumprod(np.full(K, 0.95))


def test_expensive_verification_picks_no_speculation():
    # Each verified token costs three decode tokens (bf16 on a CPU without AMX is worse):
    # at acceptance 0.95 no draft position pays, even with the draft already paid for.
    c = controller(lambda r, t: 1e-3 * r * (1 + 3 * (t - 1)), lambda r, t: 5e-4 * r * t, max_explore_probability=0.0)
    ids = [f"r{i}" for i in range(4)]
    give_history(c, ids, high_survival())
    plan = c.plan(ids, np.full(4, GREEDY))
    assert plan.q == 0 and plan.reason == OPTIMAL
    budgets = c.budgets(Plan(K, OPTIMAL), np.tile(high_survival(), (4, 1)), draft_seconds=1e-3)
    assert budgets.tolist() == [0, 0, 0, 0]


def test_free_verification_and_high_acceptance_picks_the_maximum():
    c = controller(lambda r, t: 1e-3, lambda r, t: 1e-5, max_explore_probability=0.0)
    ids = [f"r{i}" for i in range(4)]
    give_history(c, ids, high_survival())
    plan = c.plan(ids, np.full(4, GREEDY))
    assert plan.q == K
    budgets = c.budgets(plan, np.tile(high_survival(), (4, 1)), draft_seconds=1e-5)
    assert budgets.tolist() == [K] * 4


def test_budgets_follow_survival_between_requests():
    # Verification cost grows with tokens: only the likelier positions pay.
    c = controller(lambda r, t: 1e-3 * (1 + 0.3 * (t - 1) * r / 4), lambda r, t: 1e-4)
    conditional = np.array([0.97, 0.9, 0.7, 0.4, 0.1])
    survival = np.stack([np.cumprod(np.full(K, p)) for p in conditional])
    budgets = c.budgets(Plan(K, OPTIMAL), survival, draft_seconds=2e-4)
    assert np.all(np.diff(budgets) <= 0), budgets  # likelier drafts get at least as much
    assert budgets[0] > budgets[-1] and budgets[-1] == 0 and budgets[0] > 0, budgets
    # The choice is the best B: no other B gives more expected tokens per second.
    step = c.step_cost.predict(5, 1 + np.arange(5 * K + 1) / 5) + 2e-4
    b_star, _, value = best_budget(survival, 5, step)
    assert budgets.sum() == b_star
    gains = np.concatenate([[0.0], np.sort(survival.ravel())[::-1].cumsum()])
    assert value == pytest.approx(((5 + gains) / step).max())


def test_partial_prefill_rows_get_no_budget():
    c = controller(lambda r, t: 1e-3, lambda r, t: 1e-5)
    budgets = c.budgets(Plan(K, OPTIMAL), np.tile(high_survival(), (3, 1)), 1e-5, np.array([True, False, True]))
    assert budgets.tolist() == [K, 0, K]


def test_warmup_drafts_full_and_random_blocks_then_stops():
    c = BudgetController(K, 64, seed=3, warmup_steps=16)
    ids = ["a", "b"]
    plans = []
    for _ in range(16):
        plan = c.plan(ids, np.full(2, GREEDY))
        plans.append(plan.q)
        assert plan.reason == WARMUP
        budgets = c.budgets(plan, np.full((2, plan.q), 0.5), 1e-3)
        assert np.all((budgets >= 0) & (budgets <= plan.q))
        c.step_cost.observe(2, 1 + budgets.sum() / 2, 1e-3)
        c.draft_cost.observe(2, plan.q + 1, 1e-4)
    assert K in plans and len(set(plans)) > 3
    assert c.plan(ids, np.full(2, GREEDY)).reason != WARMUP
    # A new, larger batch size warms up briefly: the measured curves stand in for it meanwhile.
    new = [f"n{i}" for i in range(16)]
    reasons = []
    for _ in range(6):
        plan = c.plan(new, np.full(16, GREEDY))
        reasons.append(plan.reason)
        c.step_cost.observe(16, 2.0, 4e-3)
        c.draft_cost.observe(16, plan.q + 1, 4e-4)
    assert reasons[:4] == [WARMUP] * 4 and WARMUP not in reasons[4:], reasons
    # A size between measured ones does not warm up: the curves interpolate.
    mid = [f"m{i}" for i in range(6)]
    assert c.plan(mid, np.full(6, GREEDY)).reason != WARMUP


def test_decisions_are_deterministic_for_a_seed():
    def run(seed):
        c = BudgetController(K, 64, seed=seed)
        out = []
        for _ in range(20):
            plan = c.plan(["a"], np.full(1, GREEDY))
            out.append((plan.q, c.budgets(plan, np.full((1, plan.q), 0.5), 1e-3).tolist()))
            c.step_cost.observe(1, 2.0, 1e-3)
            c.draft_cost.observe(1, plan.q + 1, 1e-4)
        return out

    assert run(1) == run(1) and run(1) != run(2)


def test_exploration_costs_at_most_its_time_share():
    """When drafting never pays, exploring steps are rare enough that their extra
    time is explore_time_share (1%) of the whole in expectation: about 13
    exploring steps in 20,000, so the realised share is within 2% with
    probability > 0.99 (Poisson), where exploring 5% of steps (the cap on the
    probability alone) would cost 75%."""
    step_cost = lambda r, t: 1e-3 * t  # noqa: E731
    c = controller(step_cost, lambda r, t: 5e-4 * t)
    ids = ["a"]
    give_history(c, ids, np.cumprod(np.full(K, 0.5)))
    explored, extra, base, steps = 0, 0.0, 0.0, 20000
    for _ in range(steps):
        plan = c.plan(ids, np.full(1, GREEDY))
        base += 1e-3 + 5e-4
        if plan.reason == EXPLORE:
            explored += 1
            extra += 5e-4 * plan.q + 1e-3 * K  # its draft, and (at most) a full verification
    assert explored > 0, "exploration must still happen"
    assert extra / base < 0.02, (explored, extra / base)


def test_plan_values_prefer_verifying_only_the_likely_positions():
    # Cheap drafting, verification cost per token: a short draft of a confident request is best.
    c = controller(lambda r, t: 1e-3 * (1 + 0.5 * (t - 1)), lambda r, t: 1e-5 * t)
    prior = np.cumprod(np.array([0.99, 0.98, 0.5] + [0.1] * (K - 3)))[None, :]
    values, _, _, _ = c.plan_values(prior, 1)
    assert int(np.argmax(values)) in (2, 3)


def test_forced_schedules():
    jump = ForcedSchedule("jump", K, seed=0)
    qs, per_step = [], []
    for _ in range(30):
        plan = jump.plan(["a", "b", "c", "d"], np.zeros(4, dtype=int))
        qs.append(plan.q)
        per_step.append(jump.budgets(plan, np.zeros((4, plan.q)), 0.0).tolist())
    assert set(qs) == {0, K}
    assert any(len(set(b)) > 1 and 0 in b and K in b for b in per_step)
    pause = ForcedSchedule("pause:2:5", K)
    assert [pause.plan(["a"], np.zeros(1, dtype=int)).q for _ in range(7)] == [K, K, 0, 0, 0, K, K]
    with pytest.raises(ValueError, match="use 'jump' or 'pause:FIRST:END'"):
        ForcedSchedule("sometimes", K)


def test_no_draft_measured_at_one_size_is_not_scaled_up_at_another():
    """A larger batch whose steps were all drafting steps (the no-draft step measured only
    at one request, 3 ms): drafting at 8 requests costs 6 ms + 0.5 ms per verified token per
    request plus 3 ms of drafting, acceptance 0.3 per position. Not drafting (~3.75 ms for 8
    tokens) is worth twice as much per second as the best block, and the controller says so
    (it drafted, before the cost model carried the regime ratio over, because the no-draft
    step was priced at 8 single-request steps)."""
    c = BudgetController(K, 64, seed=0, max_explore_probability=0.0)
    for _ in range(20):
        c.step_cost.observe(1, 1.0, 3e-3)
        c.draft_cost.observe(1, 1.0, 0.5e-3)
        for t in (2.0, 4.0, 8.0, 16.0):
            c.step_cost.observe(1, t, 5e-3 + 0.3e-3 * t)
            c.step_cost.observe(8, t, 6e-3 + 0.5e-3 * t)
            c.draft_cost.observe(1, t, 2e-3)
            c.draft_cost.observe(8, t, 3e-3)
    for r in (1, 8):
        c._warmup_done[c._warmup_key(r)] = c.warmup_steps
        c._warmup_total += c.warmup_steps
    ids = [f"r{i}" for i in range(8)]
    give_history(c, ids, np.cumprod(np.full(K, 0.3)))
    plan = c.plan(ids, np.full(8, GREEDY))
    assert plan.q == 0 and plan.reason == OPTIMAL


def test_exploration_also_tries_no_draft():
    """While the plan drafts full blocks, an exploring step drafts nothing: the no-draft
    step's cost stays measured at every batch size."""
    c = controller(lambda r, t: 1e-3, lambda r, t: 1e-5, max_explore_probability=0.5, explore_time_share=1.0)
    ids = [f"r{i}" for i in range(4)]
    give_history(c, ids, np.cumprod(np.full(K, 0.6)))
    plans = [c.plan(ids, np.full(4, GREEDY)) for _ in range(400)]
    assert {p.q for p in plans if p.reason == OPTIMAL} == {K}
    explored = [p.q for p in plans if p.reason == EXPLORE]
    assert len(explored) > 50 and set(explored) == {0}


def test_no_exploration_without_drafts_where_the_epochs_confirmed_drafting():
    """Where the policy epochs have drafting ahead (`PolicyEpochs.confirmed`: here ADAPTIVE's
    epochs 1.5x OFF's), their OFF epochs measure the no-draft step: the same plans as in
    `test_exploration_also_tries_no_draft` never explore without drafts (a full-block plan then
    does not explore at all), and a shorter plan (drafting priced 10x higher: q = 2) explores
    longer blocks only. With the epochs level (1.0x) they still explore without drafts."""
    for adaptive_rate, draft_cost, confirmed in ((1500.0, 1e-5, True), (1000.0, 1e-5, False), (1500.0, 1e-4, True)):
        c = controller(lambda r, t: 1e-3 * (1 + 0.2 * (t - 1)), lambda r, t, d=draft_cost: d * t,
                       max_explore_probability=0.5, explore_time_share=1.0)
        ids = [f"r{i}" for i in range(4)]
        give_history(c, ids, np.cumprod(np.full(K, 0.6)))
        measured_epochs(c.epochs, 4, off_rate=1000.0, adaptive_rate=adaptive_rate)
        assert c.epochs.confirmed(4) == confirmed
        plans = [c.plan(ids, np.full(4, GREEDY)) for _ in range(400)]
        planned = {p.q for p in plans if p.reason == OPTIMAL}
        explored = [p.q for p in plans if p.reason in (EXPLORE, PROBE)]
        assert len(planned) == 1 and min(planned) > 0
        if confirmed:
            assert all(q > min(planned) for q in explored)
            assert (len(explored) > 20) == (min(planned) < K)
        else:
            assert explored.count(0) > 20


def test_exploring_a_full_block_plan_is_priced_by_the_output_it_forgoes():
    """At full blocks an exploring step drafts nothing: it costs the plan's tokens per
    second it forgoes, not the (zero) extra seconds of longer blocks. One request,
    verification nearly free, drafts accepted: the plan's value is several times the
    no-draft value, so an exploring step costs most of a step and explores at
    explore_time_share / that, well under the cap (priced as longer blocks, it sat at
    the cap)."""
    c = controller(lambda r, t: 5e-3 * (1 + 0.01 * (t - 1)), lambda r, t: 1e-3, max_explore_probability=0.05,
                   explore_time_share=0.01)
    ids = ["r0"]
    give_history(c, ids, high_survival())
    plan = c.plan(ids, np.full(1, GREEDY))
    entry = c._cache[1]
    assert entry.q == K and plan.q in (0, K)
    values = c.plan_values(c.prior.rows(ids, np.full(1, GREEDY)), 1)[0]
    forgone = 1.0 - values[0] / values[K]
    assert 0.6 < forgone < 0.9
    assert c._explore_probability(entry) == pytest.approx(0.01 / forgone, rel=1e-6)
    # Each exploration is a run of probe_steps steps that draft nothing: it starts that many times less often.
    assert c._explore_start(entry) == pytest.approx(0.01 / forgone / c.probe_steps, rel=1e-6)
    # A plan that drafts nothing still prices exploring as the longer blocks' extra seconds.
    c0 = controller(lambda r, t: 1e-3 * r * t, lambda r, t: 2e-4 * t, max_explore_probability=0.05,
                    explore_time_share=0.01)
    ids = [f"r{i}" for i in range(16)]
    give_history(c0, ids, np.cumprod(np.full(K, 0.3)))
    c0.plan(ids, np.full(16, GREEDY))
    e0 = c0._cache[16]
    assert e0.q == 0
    assert c0._explore_probability(e0) == pytest.approx(0.01 * e0.seconds / (e0.full_seconds - e0.seconds))


def test_a_new_request_is_planned_for_its_own_prior_within_a_few_steps():
    """One request at a time: a plan made for a request whose drafts were rejected (q = 0)
    is redone for the next request, with a strong survival row, after refresh_steps // 4
    decisions, not after the full (possibly doubled) refresh interval."""
    c = controller(lambda r, t: 1e-3 * (1 + 0.02 * (t - 1)), lambda r, t: 2e-4 * t, max_explore_probability=0.0)
    kinds = np.full(1, GREEDY)
    give_history(c, ["poor"], np.cumprod(np.full(K, 0.02)))
    assert c.plan(["poor"], kinds).q == 0
    for _ in range(40):  # the same plan again and again: a plan of no draft is still redone within
        c.plan(["poor"], kinds)  # the steps its request's own row takes to fade (at one request)
    assert c._cache[1].interval <= c.prior.fade_steps < c.refresh_steps
    while c._cache[1].stamp != c._decisions:  # up to the poor request's latest replan
        c.plan(["poor"], kinds)
    give_history(c, ["rich"], high_survival())
    qs = [c.plan(["rich"], kinds).q for _ in range(c.refresh_steps // 4 + 1)]
    assert qs[0] == 0 and qs[-1] > 0, qs  # the old plan for a few steps, then its own


def test_a_plan_for_requests_without_priors_of_their_own_carries_over_to_the_next_such_requests():
    """Requests that never drafted are planned on their kinds' means alone (`_plan_basis`), so
    a cached plan holds for the next such requests with the same mix of kinds: it is not redone
    refresh_steps // 4 decisions after they arrive, and its interval keeps doubling. Requests
    coming and going every few dozen steps had replanned every 16-32 steps (~1.2 ms each in the
    engine). Requests with a row of their own, a shift that lifts one of them, or another mix of
    kinds get a plan of their own within refresh_steps // 4 decisions, as any other requests did."""
    c = controller(lambda r, t: 1e-3 * r * t, lambda r, t: 2e-4 * t, max_explore_probability=0.0)
    kinds = np.full(4, GREEDY)
    stamps = set()
    for wave in range(40):  # 320 decisions, a new set of requests every 8
        ids = [f"w{wave}r{i}" for i in range(4)]
        for _ in range(8):
            assert c.plan(ids, kinds).q == 0
            stamps.add(c._cache[4].stamp)
        assert c._cache[4].req_ids == ids  # carried over: steady_run gives these the plan's interval
        assert c.steady_run(ids, 100)[0] > 0 or c._decisions - c._cache[4].stamp >= c._cache[4].interval - 1
    # replans at decisions 1, 17, 49, 113, 177, 241, 305: intervals 16, 32, then 4 x refresh_steps
    assert sorted(stamps) == [1, 17, 49, 113, 177, 241, 305], sorted(stamps)
    assert c._cache[4].interval == 4 * c.refresh_steps

    def replanned_for(ids, kinds_now=kinds):
        """Whether a plan of their own is made within refresh_steps // 4 decisions of theirs."""
        before = c._cache[4].stamp
        for _ in range(c.refresh_steps // 4):
            c.plan(ids, kinds_now)
        return c._cache[4].stamp != before

    assert not replanned_for([f"x{i}" for i in range(4)])
    give_history(c, ["own"], np.cumprod(np.full(K, 0.5)))  # drafted lately: its own row weighs in
    assert replanned_for(["own", "y1", "y2", "y3"])
    assert c._cache[4].basis is None  # a plan that rested on 'own' carries over to nobody
    zs = ["z0", "z1", "z2", "z3"]
    assert replanned_for(zs) and c._cache[4].req_ids == zs and c._cache[4].basis == (4, 0)
    c.prior.forget([], steps=int(c.prior.fade_steps * 10))  # 'own' long gone
    assert not replanned_for(["b0", "b1", "b2", "b3"])
    c.request_shifts = lambda ids: np.array([0.5 if r == "easy" else -0.5 if r == "hard" else 0.0 for r in ids])
    assert not replanned_for(["hard", "c1", "c2", "c3"])  # a shift below its kind's mean is not applied
    assert replanned_for(["easy", "d1", "d2", "d3"])
    c.request_shifts = None
    assert replanned_for(["e0", "e1", "e2", "e3"])
    mixed = np.array([GREEDY, GREEDY, GREEDY, SAMPLED])
    assert replanned_for(["f0", "f1", "f2", "f3"], mixed)
    assert not replanned_for(["g0", "g1", "g2", "g3"], mixed)


def test_a_plan_of_no_draft_at_one_request_is_redone_as_its_request_row_fades():
    """One request whose last draft was poor plans no draft; its own survival row fades
    into the kind's mean within `fade_steps` decisions, and so the plan is redone then
    (drafting resumes when the mean says it pays), not after up to 4 x refresh_steps:
    at one request the coasting that followed one poor draft had run at half the tokens
    per second of drafting. At many requests the cap is R x fade_steps (a row weighs 1/R)."""
    c = controller(lambda r, t: 1e-3 * (1 + 0.02 * (t - 1)), lambda r, t: 2e-4 * t, max_explore_probability=0.0)
    kinds = np.full(1, GREEDY)
    c.prior.record(["x", "y", "z"], np.full(3, GREEDY), np.tile(high_survival(), (3, 1)))  # the kind's mean
    c.prior.record(["a"], kinds, np.cumprod(np.full(K, 0.02))[None, :])  # a's own last draft: poor
    assert c.plan(["a"], kinds).q == 0
    qs = []
    for _ in range(int(c.prior.fade_steps) * 3):
        c.prior.forget(["a"])  # one engine step
        qs.append(c.plan(["a"], kinds).q)
    assert qs[-1] > 0 and qs.index(next(q for q in qs if q > 0)) < 3 * c.prior.fade_steps
    c16 = controller(lambda r, t: 1e-3 * r * t, lambda r, t: 2e-4 * t, max_explore_probability=0.0)
    ids = [f"r{i}" for i in range(16)]
    assert c16.plan(ids, np.full(16, GREEDY)).q == 0  # verifying costs what a step yields: no draft
    assert c16._cache[16].interval == min(c16.refresh_steps, int(c16.prior.fade_steps * 16))
    # Requests without rows of their own (none drafted lately): nothing fades, and the same plan
    # is trusted twice as long at each replan, up to 4 x refresh_steps, past R x fade_steps; up to
    # NO_DRAFT_REFRESH_FACTOR x once the measured arms say not drafting is ahead (the curves can no
    # longer change the plan). A no-draft plan of the curves alone is not stretched further: at one
    # request that had kept one request's plan of no draft for all its tokens.
    c4 = controller(lambda r, t: 1e-3 * r * t, lambda r, t: 2e-4 * t, max_explore_probability=0.0)
    ids4, kinds4 = [f"r{i}" for i in range(4)], np.full(4, GREEDY)
    assert not c4.prior.fading(ids4)
    intervals = []
    for _ in range(300):
        assert c4.plan(ids4, kinds4).q == 0
        intervals.append(c4._cache[4].interval)
    assert c4.verdict(4) == 0 and max(intervals) == 4 * c4.refresh_steps > c4.prior.fade_steps * 4
    for _ in range(20):  # the arms: 20 tok/s without drafts, 10 with
        c4.arms.observe(4, False, 0.2, 4.0)
        c4.arms.observe(4, True, 0.4, 4.0 * (1 + 0.01 * (_ % 3)))
    assert c4.verdict(4) < 0
    intervals = []
    for _ in range(600):
        assert c4.plan(ids4, kinds4).q == 0
        intervals.append(c4._cache[4].interval)
    assert {c4.refresh_steps * f for f in (1, 2, 4, 8, 16)} <= set(intervals)
    assert c4._cache[4].interval == NO_DRAFT_REFRESH_FACTOR * c4.refresh_steps
    c4.prior.record(ids4[:1], kinds4[:1], np.cumprod(np.full(K, 0.02))[None, :])  # one request's own poor row
    assert c4.prior.fading(ids4)
    c4._cache.clear()
    for _ in range(200):
        c4.plan(ids4, kinds4)
    assert c4._cache[4].interval <= c4.prior.fade_steps * 4


def test_switch_pays_compares_finishing_times():
    """Drafting at 20 tok/s after a 1 s write finishes 40 tokens in 3 s, not drafting at 10 tok/s
    in 4 s: it pays; 10 tokens take 1.5 s against 1 s: it does not. No write, or requests
    without a token limit: it pays."""
    assert BudgetController.switch_pays(10.0, 20.0, 1.0, 40)
    assert not BudgetController.switch_pays(10.0, 20.0, 1.0, 10)
    assert BudgetController.switch_pays(10.0, 20.0, 0.0, 10)
    assert BudgetController.switch_pays(10.0, 20.0, 5.0, None)


def test_held_context_keeps_drafting_off_until_the_tokens_left_repay_its_write():
    """Verification is free and acceptance high, so the plan drafts the maximum; with held
    context rows to write first (the switch), it drafts only when the requests have enough
    tokens left for drafting's faster rate to repay that write (`switch_pays`)."""
    c = controller(lambda r, t: 1e-3, lambda r, t: 1e-5, max_explore_probability=0.0)
    ids = [f"r{i}" for i in range(4)]
    give_history(c, ids, high_survival())
    kinds = np.full(4, GREEDY)
    switch = {"cost": (0.05, 8)}  # 50 ms of held rows, 8 tokens left: a step makes 4 tokens a ms
    c.switch_cost = lambda req_ids: switch["cost"]
    assert c.plan(ids, kinds).q == 0
    entry = c._cache[4]
    assert entry.other_q == K and not entry.probe  # a plan turned off by the switch is not probed
    switch["cost"] = (0.05, 10_000)  # enough tokens left: drafting's rate repays the write
    c._cache.clear()
    assert c.plan(ids, kinds).q == K
    switch["cost"] = (0.05, None)
    c._cache.clear()
    assert c.plan(ids, kinds).q == K


def test_an_exploration_of_a_no_draft_plan_is_priced_with_the_held_context_it_writes():
    """A plan that does not draft explores less when its exploring step must first write held
    context: its exploration cost grows by the write's seconds over the planned step's."""
    step_cost = lambda r, t: 1e-3 * t  # noqa: E731
    c = controller(step_cost, lambda r, t: 5e-4 * t)
    ids = ["a"]
    give_history(c, ids, np.cumprod(np.full(K, 0.5)))
    c.plan(ids, np.full(1, GREEDY))
    plain = c._cache[1]
    assert plain.q == 0
    c.switch_cost = lambda req_ids: (0.015, 100)
    c._cache.clear()
    c.plan(ids, np.full(1, GREEDY))
    held = c._cache[1]
    assert held.explore_cost == pytest.approx(plain.explore_cost + 0.015 / plain.seconds)
    assert c._explore_probability(held) < c._explore_probability(plain)


def test_an_exploration_is_priced_in_measured_seconds():
    """Where cycles ran against the curves' forecast by factors (plain steps at half their
    forecast, drafting ones at 1.5x), a plan without drafts prices its exploring step's longer
    blocks in those measured seconds: 1.5 x full over 0.5 x the plan's step, and explores
    less than the bare curves would have it."""
    c = controller(lambda r, t: 1e-3 * r * t, lambda r, t: 2e-4 * t, max_explore_probability=0.05,
                   explore_time_share=0.01)
    ids = [f"r{i}" for i in range(16)]
    give_history(c, ids, np.cumprod(np.full(K, 0.3)))
    kinds = np.full(16, GREEDY)
    c.plan(ids, kinds)
    bare = c._cache[16]
    assert bare.q == 0 and bare.factors == (1.0, 1.0)
    assert bare.explore_cost == pytest.approx((bare.full_seconds - bare.seconds) / bare.seconds)
    c.time_factors = lambda requests: (0.5, 1.5)
    c._cache.clear()
    c.plan(ids, kinds)
    measured = c._cache[16]
    assert measured.q == 0 and measured.factors == (0.5, 1.5)
    assert measured.explore_cost == pytest.approx((1.5 * bare.full_seconds - 0.5 * bare.seconds)
                                                  / (0.5 * bare.seconds))
    assert c._explore_probability(measured) < c._explore_probability(bare) / 3


def test_a_longer_block_that_costs_the_same_is_planned():
    """One request, drafting cost the same for any block (one query-block forward), the prior
    expecting the best budget well short of k: every block from that budget on has the same
    plan value. The plan takes the longest of them (k), so a confident draft can be verified
    deeper than the average one; it took the shortest, and capped every budget there. Where a
    longer block costs more than the tolerance, the shorter one stays."""
    step = lambda r, t: 1e-3 * (1 + 0.05 * (t - 1))  # noqa: E731  verifying costs: the best B is short
    prior = np.cumprod(np.full(K, 0.5))
    flat = controller(step, lambda r, t: 2e-4 if t > 1 else 2e-5, max_explore_probability=0.0)
    give_history(flat, ["a"], prior)
    plan = flat.plan(["a"], np.full(1, GREEDY))
    values = flat.plan_values(flat.prior.rows(["a"], np.full(1, GREEDY)), 1)[0]
    shortest = 1 + int(np.argmax(values[1:]))
    assert shortest < K and values[K] == pytest.approx(values[shortest], rel=1e-9)
    assert plan.q == K
    rising = controller(step, lambda r, t: 2e-4 * (1 + 0.05 * (t - 1)), max_explore_probability=0.0)
    give_history(rising, ["a"], prior)
    values = rising.plan_values(rising.prior.rows(["a"], np.full(1, GREEDY)), 1)[0]
    q = rising.plan(["a"], np.full(1, GREEDY)).q
    assert q == 1 + BudgetController.longest_near_best(values[1:]) < K
    assert values[q] >= values[1:].max() * (1 - LONGER_BLOCK_TOLERANCE) > values[q + 1]
    assert BudgetController.longest_near_best(np.array([1.0, 2.0, 1.975, 1.9])) == 2
    assert BudgetController.longest_near_best(np.array([1.0, 2.0, 1.93])) == 1


def test_a_plan_at_one_request_is_valued_over_its_kinds_recent_drafts():
    """A few confident drafts among many doubtful ones (6 rows surviving at 0.97 a position,
    26 at 0.5), a verified position costing a tenth of a step and a longer block a tenth of a
    one-position block more per position. On the mean row, deep positions look poor and the
    plan cuts the block at 9; valued row by row (each verifying as its own budget would), the
    confident drafts pay for the full block, and the plan drafts k. The sampled value of each
    q is the total tokens over the total seconds of the rows at their best budgets."""
    step = lambda r, t: 1e-3 * (1 + 0.1 * (t - 1))  # noqa: E731
    draft = lambda r, t: 2e-4 * (1 + 0.1 * (t - 1)) if t > 1 else 2e-5  # noqa: E731
    pos = np.arange(1, K + 1)
    rows = np.concatenate([np.tile(0.97 ** pos, (6, 1)), np.tile(0.5 ** pos, (26, 1))])
    c = controller(step, draft, max_explore_probability=0.0)
    c.prior.record([f"r{i}" for i in range(len(rows))], np.full(len(rows), GREEDY), rows)
    assert np.allclose(c.prior.recent(GREEDY), rows)
    assert c.plan(["new"], np.full(1, GREEDY)).q == K
    mean_values = c.plan_values(rows.mean(axis=0)[None], 1)[0]
    assert 1 + BudgetController.longest_near_best(mean_values[1:]) < K
    steps = c.step_cost.predict(1, 1.0 + np.arange(K + 1))
    drafts = c.draft_cost.predict(1, 1.0 + np.arange(K + 1))
    values, seconds, _, verifies = c.plan_values_sampled(rows, steps, drafts)
    gains = np.concatenate([[0.0], np.cumsum(rows[0])]), np.concatenate([[0.0], np.cumsum(rows[-1])])
    for q in (0, 5, K):
        tokens = time = 0.0
        for row_gains, count in zip(gains, (6, 26)):
            b = int(np.argmax([(1 + row_gains[b]) / (steps[b] + drafts[q]) for b in range(q + 1)]))
            tokens, time = tokens + count * (1 + row_gains[b]), time + count * (steps[b] + drafts[q])
        assert values[q] == pytest.approx(tokens / time, rel=1e-12)
        assert seconds[q] == pytest.approx(time / len(rows), rel=1e-12)
    assert not verifies[0] and verifies[K]


def test_the_recent_rows_are_the_last_ones_of_each_kind_extended_to_k():
    from vllm_dflash.adaptive.calibration import SAMPLED, SurvivalPrior

    prior = SurvivalPrior(4, recent_rows=3)
    prior.record(["a", "b"], np.array([GREEDY, SAMPLED]), np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.25, 0.1, 0.05]]))
    prior.record(["c", "d", "e"], np.full(3, GREEDY), np.array([[0.8, 0.6], [0.7, 0.5], [0.6, 0.4]]))
    recent = prior.recent(GREEDY)
    assert recent.shape == (3, 4)  # the ring holds the last three greedy rows, in ring order
    assert sorted(recent[:, 0].tolist()) == [0.6, 0.7, 0.8] and 0.9 not in recent[:, 0]
    assert np.all(np.diff(recent, axis=1) <= 0) and np.all(recent[:, 2:] > 0)  # continued past position 2
    assert np.allclose(prior.recent(SAMPLED), [[0.5, 0.25, 0.1, 0.05]])
    assert prior.recent(GREEDY).base is not prior._recent  # a copy: the caller may change it


def measured_epochs(epochs, requests: int, off_rate: float, adaptive_rate: float = 1000.0) -> None:
    """`min_epochs` epochs of each policy at these rates, and as many pairs of neighbours (OFF leads
    where off_rate is higher)."""
    n = float(epochs.min_epochs)
    epochs._sums[requests] = [[n, n * math.log(rate), n * math.log(rate) ** 2] for rate in (adaptive_rate, off_rate)]
    d = math.log(adaptive_rate / off_rate)
    epochs._pairs[requests] = [n, n * d, n * d * d]


def test_a_small_curve_lead_does_not_draft_where_the_epochs_ran_off_faster():
    """The arms undecided and the epochs' OFF policy measured ahead (`PolicyEpochs.off_leads`): the
    curves must put drafting more than `probe_margin` (e^0.2 = 1.22x) ahead. Drafting's seconds are
    scaled so that the curves' best drafting value is 1.1x, then 1.4x, not drafting's: without the
    lead both draft; with it only the second. The cached plan is redone when the lead changes."""
    c = controller(lambda r, t: 1e-3, lambda r, t: 1e-4, max_explore_probability=0.0, probe_probability=0.0)
    ids = [f"r{i}" for i in range(4)]
    give_history(c, ids, np.cumprod(np.full(K, 0.7)))
    kinds = np.full(4, GREEDY)
    assert c.plan(ids, kinds).q > 0
    base = c._cache[4].draft_ratio
    assert base > 1.5
    for ratio, drafts_with_lead in ((1.1, False), (1.4, True)):
        c.time_factors = lambda requests, f=base / ratio: (1.0, f)
        measured_epochs(c.epochs, 4, off_rate=900.0)
        c._cache.clear()
        assert c.plan(ids, kinds).q > 0
        assert c._cache[4].draft_ratio == pytest.approx(ratio, rel=1e-6)
        assert c.steady_run(ids, most=8, drafting=True)[0] > 0
        measured_epochs(c.epochs, 4, off_rate=1100.0)
        assert c.steady_run(ids, most=8, drafting=True) == (0, 0)  # the plan is redone at once
        plan = c.plan(ids, kinds)
        assert (plan.q > 0) == drafts_with_lead and c._cache[4].off_lead
        if not drafts_with_lead:
            assert c._cache[4].other_q > 0 and not c._cache[4].probe
