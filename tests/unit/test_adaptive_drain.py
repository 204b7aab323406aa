"""The drain at the end of a busy period (vllm_dflash.adaptive.drain): requests that
drafting put out of step finish one by one, in steps with fewer requests. Its cost is
measured per peak batch size and weighs on drafting's value there."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dflash.adaptive.drain import DrainLoss
from vllm_dflash.adaptive.speculation import AdaptiveSpeculation

from test_adaptive_realized import _controller_drafting_at_8

KNOTS = [1, 2, 4, 8, 16]


def _period(drain: DrainLoss, peak: int, drafted: bool, peak_steps: int, peak_rate: float,
            drain_steps: list[tuple[int, float, float]], step_seconds: float = 0.01) -> None:
    """A closed period: `peak_steps` steps at `peak` requests yielding `peak_rate` tokens per
    second, then the drain's (requests, tokens, seconds) steps."""
    for _ in range(peak_steps):
        drain.step(peak, drafted, step_seconds, peak_rate * step_seconds)
    for requests, tokens, seconds in drain_steps:
        drain.step(requests, drafted, seconds, tokens)
    drain.end_period()


def test_a_drain_loses_what_the_peak_rate_would_have_made_in_its_time():
    d = DrainLoss(KNOTS)
    # 20 steps at 8 requests, 1600 tok/s (320 tokens); then 10 steps at 4 requests, 8 tokens in 8 ms each
    # (1000 tok/s): 80 ms that the peak's rate fills with 128 tokens, 48 more than the drain made.
    _period(d, 8, True, 20, 1600.0, [(4, 8.0, 0.008)] * 10)
    tokens, lost_none, lost_draft = d.lost_tokens(8)
    assert (tokens, lost_none) == (pytest.approx(400.0), 0.0)
    assert lost_draft == pytest.approx(48.0)
    assert d.factor(8) == pytest.approx(400.0 / 448.0)
    assert d.factor(7) == d.factor(8)  # nearest knot
    assert d.factor(4) == 1.0 and d.factor(16) == 1.0  # nothing measured there


def test_a_dip_the_peak_comes_back_from_is_no_drain():
    """A request finished and its successor's prompt came a step later: not the end."""
    d = DrainLoss(KNOTS)
    for _ in range(10):
        d.step(8, True, 0.01, 16.0)
    d.step(7, True, 0.02, 7.0)  # slow and short, then the peak again
    for _ in range(10):
        d.step(8, True, 0.01, 16.0)
    d.end_period()
    assert d.lost_tokens(8)[2] == 0.0 and d.factor(8) == 1.0


def test_a_period_counts_as_drafting_beyond_exploration_s_share_of_its_peak_steps():
    """Some drafting puts requests out of step for the rest of a period: 38% of the peak steps
    drafting is a drafting period; 1 step in 40 (exploration) is not."""
    d = DrainLoss(KNOTS, no_draft_share=0.05)
    for drafted_steps, steps in ((15, 40), (1, 40)):
        for i in range(steps):
            d.step(8, i < drafted_steps, 0.01, 16.0)
        d.step(4, False, 0.01, 6.0)  # a drain: 10 ms, 16 tokens at the peak's rate, 6 made
        d.end_period()
    _, lost_none, lost_draft = d.lost_tokens(8)
    assert lost_none == pytest.approx(10.0) and lost_draft == pytest.approx(10.0)
    with pytest.raises(ValueError, match="no_draft_share"):
        DrainLoss(KNOTS, no_draft_share=1.0)


def test_periods_without_a_drain_to_measure_are_not_counted():
    d = DrainLoss(KNOTS, min_peak_steps=4)
    _period(d, 1, True, 50, 100.0, [])  # one request: nothing can finish apart
    _period(d, 8, True, 3, 1600.0, [(4, 8.0, 0.008)] * 10)  # too few steps at the peak for its rate
    d.end_period()  # an empty period
    assert d.periods_seen == 0 and d.factor(8) == 1.0


def test_the_drain_of_periods_without_drafting_offsets_that_of_drafting_ones():
    """Work that stops arriving unevenly drains either way; only drafting's extra drain
    counts against it: (N + L_none) / (N + L_draft)."""
    d = DrainLoss(KNOTS, memory=1e9)
    _period(d, 8, False, 20, 1000.0, [(4, 5.0, 0.01)] * 4)  # 40 ms at 1000 tok/s: 40 tokens, 20 made
    _period(d, 8, True, 20, 1600.0, [(4, 8.0, 0.008)] * 10)  # 48 lost
    tokens, lost_none, lost_draft = d.lost_tokens(8)
    assert lost_none == pytest.approx(20.0) and lost_draft == pytest.approx(48.0)
    assert tokens == pytest.approx((220.0 + 400.0) / 2)
    assert d.factor(8) == pytest.approx((tokens + 20.0) / (tokens + 48.0))
    # A drain that ran faster per token than its peak (drafting pays more at fewer requests)
    # counts no gain: the factor never rewards drafting for a drain.
    d2 = DrainLoss(KNOTS)
    _period(d2, 8, True, 20, 1000.0, [(4, 20.0, 0.01)] * 5)
    assert d2.lost_tokens(8)[2] < 0 and d2.factor(8) == 1.0


def test_a_kind_that_stops_running_fades_and_longer_periods_weigh_the_drain_less():
    d = DrainLoss(KNOTS, memory=8, stale_factor=4)
    _period(d, 8, True, 20, 1600.0, [(4, 8.0, 0.008)] * 10)
    first = d.factor(8)
    assert first < 1.0
    for _ in range(8):  # busy periods three times as long, without drafting or a drain
        _period(d, 8, False, 60, 1000.0, [])
    later = d.factor(8)
    assert first < later < 1.0  # the same drain amortised over more work
    assert d.lost_tokens(8)[2] == pytest.approx(48.0)
    # Its one period's evidence fades by 1 - 1/32 a period: below half a period after 22 more.
    for _ in range(13):
        _period(d, 8, False, 60, 1000.0, [])
    assert d.lost_tokens(8)[2] == pytest.approx(48.0)
    _period(d, 8, False, 60, 1000.0, [])
    assert d.lost_tokens(8)[2] == 0.0 and d.factor(8) == 1.0  # drafting is tried again


def test_the_drain_turns_a_plan_to_draft_into_no_draft():
    """Curves that put drafting ~13% ahead per cycle (slope 0.3) plan to draft; busy periods
    whose drain cost drafting 25% of their tokens take that lead away."""
    c, ids, kinds = _controller_drafting_at_8(slope=0.3, refresh_steps=1)
    assert c.plan(ids, kinds).q > 0
    for _ in range(2):
        _period(c.drain, 8, True, 20, 1600.0, [(4, 8.0, 0.01)] * 20)  # 160 ms: 256 tokens, 160 made: 96 lost
    assert c.drain.factor(8) < 0.8
    assert c.time_factors(8)[1] == pytest.approx(1.0 / c.drain.factor(8))
    assert c.plan(ids, kinds).q == 0


def test_the_drain_weighs_on_the_measured_arms_verdict():
    """Drafting cycles measured 10% ahead beyond their noise: a verdict to draft, until
    the drain (a factor of ~0.8) reverses it."""
    c, _, _ = _controller_drafting_at_8()
    rng = np.random.default_rng(0)
    for _ in range(64):
        c.arms.observe(8, True, 0.01 * np.exp(rng.normal(0, 0.02)), 11.0)
        c.arms.observe(8, False, 0.01 * np.exp(rng.normal(0, 0.02)), 10.0)
    assert c.verdict(8) == 1
    _period(c.drain, 8, True, 20, 1600.0, [(4, 8.0, 0.01)] * 20)
    assert c.drain.factor(8) < 0.85
    assert c.verdict(8) == -1


def _step(spec: AdaptiveSpeculation, now: float, req_ids: list[str], num_tokens: int) -> None:
    n = len(req_ids)
    none = np.zeros(n, dtype=np.int64)
    plan = spec.begin(now, req_ids, none, none, num_tokens, np.ones(n, bool), np.ones(n, bool))
    feature = np.full((n, plan.q), 0.5)
    spec.choose(now + 0.001, feature, feature)
    spec.end(now + 0.002)


def test_speculation_closes_a_busy_period_when_new_requests_come_after_the_engine_idled():
    spec = AdaptiveSpeculation(4, 16, schedule="pause:0:1000")  # never drafts
    c = spec.controller
    c.step_cost.observe(4, 1.0, 0.008)
    t = 0.0
    batch = ["a", "b", "c", "d"]
    _step(spec, t, batch, 40)  # prompts
    for _ in range(10):
        t += 0.01
        _step(spec, t, batch, 4)
    for _ in range(3):  # a and b finished: the drain
        t += 0.01
        _step(spec, t, ["c", "d"], 2)
    t += 0.01
    _step(spec, t, ["e", "f", "g", "h"], 40)  # new requests right after: a prompt step, no idle gap
    assert c.drain.periods_seen == 0
    for _ in range(5):
        t += 0.01
        _step(spec, t, ["e", "f", "g", "h"], 4)
    t += 5.0  # the engine idled
    _step(spec, t, ["x", "y", "z", "w"], 40)
    assert c.drain.periods_seen == 1
    # Peak 4 at 4 tokens per 10 ms (400 tok/s); the drain: c and d, 2 tokens per 10 ms, for 30 ms,
    # then the peak again (e-h): no drain at the end.
    assert c.drain.lost_tokens(4) == (pytest.approx(4 * 10 + 2 * 3 + 4 * 6), 0.0, 0.0)


def test_coasted_steps_reach_the_busy_period_when_their_run_is_folded():
    """Steps that coast (logged, folded later in one loop) count in the period like any other."""
    from test_adaptive_speculation import _coasting_spec

    spec = _coasting_spec(max_explore_probability=0.0)  # two requests, plan no draft; one step taken at 0.0
    drain = spec.controller.drain
    now, coasted = 0.0, 0
    for _ in range(8):
        now += 0.01
        if spec.coast(now, ["a", "b"], 2):
            coasted += 1
            spec.end_coast(now, now + 0.002)
        else:
            _step(spec, now, ["a", "b"], 2)
    assert coasted >= 6
    now += 0.01
    _step(spec, now, ["b"], 1)  # a finished: the batch changed, the run is folded first; b drains
    assert drain._open.peak_steps == 8 and drain._open.tokens == 8 * 2 + 1
    now += 5.0  # the engine idled; new requests
    _step(spec, now, ["x", "y"], 30)
    assert drain.periods_seen == 1
    # 2 tokens per 10 ms at the peak; the drain made 1 token in 10 ms: 1 lost, no drafting.
    assert drain.lost_tokens(2) == (pytest.approx(17.0), pytest.approx(1.0), 0.0)
