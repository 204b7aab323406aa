"""The online step-cost surface: interpolation, monotonicity, sane extrapolation, robustness."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dflash.adaptive.cost_model import StepCost, local_linear, pool_adjacent_violators, request_knots


def linear_cost(r: float, t: float) -> float:
    return 1e-3 * (1.0 + 0.05 * r * t)  # a fixed part plus a part per computed token


def test_request_knots_are_geometric_and_cover_the_batch():
    knots = request_knots(64)
    assert list(knots[:8]) == [1, 2, 3, 4, 6, 8, 12, 16] and knots[-1] >= 64
    assert np.all(np.diff(knots) > 0)


def test_pool_adjacent_violators_gives_the_weighted_monotone_fit():
    fit = pool_adjacent_violators(np.array([1.0, 3.0, 2.0, 4.0]), np.array([1.0, 1.0, 3.0, 1.0]))
    np.testing.assert_allclose(fit, [1.0, 2.25, 2.25, 4.0])


def test_learns_a_surface_and_interpolates_unseen_points():
    cost = StepCost(16, 64)
    rng = np.random.default_rng(0)
    for _ in range(400):
        r = int(rng.choice([1, 4, 16, 64]))
        t = float(rng.choice([1, 4, 8, 16]))
        cost.observe(r, t, linear_cost(r, t))
    # t and R between measured knots (t = 1, no drafts, is a regime of its own: below t = 4 the
    # shortest block measured prices shorter ones, test_shorter_blocks_than_measured_...)
    for r, t in ((4, 6.0), (16, 5.5), (64, 12.0), (8, 8.0)):
        got = float(cost.predict(r, [t])[0])
        assert got == pytest.approx(linear_cost(r, t), rel=0.15), (r, t)


def test_predictions_are_monotone_in_tokens_despite_noise():
    cost = StepCost(16, 8)
    rng = np.random.default_rng(1)
    for _ in range(300):
        t = float(rng.integers(1, 17))
        cost.observe(8, t, linear_cost(8, t) * rng.uniform(0.5, 1.5))
    pred = cost.predict(8, np.linspace(1, 16, 61))
    assert np.all(np.diff(pred) >= -1e-15)


def test_rarely_measured_points_lean_on_well_measured_neighbours():
    """Draft time linear in q, measured 50 times at q = 0, 1, 8, 15 and once, with +-40% noise,
    at the other q: predictions stay within 12% of the line (raw once-measured means would
    be off by up to 40%). (q = 0 is fitted on its own: see the jump test below.)"""
    cost = StepCost(16, 4)
    rng = np.random.default_rng(3)
    line = lambda t: 1e-3 * (1 + 0.5 * t)  # noqa: E731
    for t in range(1, 17):
        for _ in range(50 if t in (1, 2, 9, 16) else 1):
            cost.observe(1, t, line(t) * (rng.uniform(0.6, 1.4) if t not in (1, 2, 9, 16) else rng.uniform(0.98, 1.02)))
    pred = cost.predict(1, np.arange(1, 17))
    assert np.all(np.abs(pred / line(np.arange(1, 17)) - 1) < 0.12), pred / line(np.arange(1, 17))
    assert np.all(np.diff(pred) >= 0)


def test_the_jump_from_no_drafts_to_drafts_is_kept():
    """Drafting: 1 ms for the context write alone (t = 1), 5 ms + 0.2 ms per token for a
    query block (t >= 2). Smoothing across the jump would make t = 1 dearer and short
    blocks cheaper, tilting every decision toward drafting; fitted apart, t = 1 stays
    1 ms, and a step where only some requests verify (1 < t < 2) pays the block regime."""
    cost = StepCost(16, 8)
    rng = np.random.default_rng(5)
    truth = lambda t: np.where(np.asarray(t) <= 1, 1e-3, 5e-3 + 0.2e-3 * np.asarray(t))  # noqa: E731
    for _ in range(400):
        t = float(rng.integers(1, 17))
        cost.observe(4, t, float(truth(t)) * rng.uniform(0.97, 1.03))
    pred = cost.predict(4, [1.0, 1.5, 2.0, 3.0, 16.0])
    assert pred[0] == pytest.approx(1e-3, rel=0.03)
    assert pred[1] == pytest.approx(5.3e-3, rel=0.05) and pred[2] == pytest.approx(5.4e-3, rel=0.05)
    assert np.all(np.abs(pred[2:] / truth([2.0, 3.0, 16.0]) - 1) < 0.05)


def test_never_zero_and_pessimistic_beyond_the_measured_range():
    cost = StepCost(16, 8)
    for _ in range(10):
        cost.observe(2, 2.0, 0.004)
    pred = cost.predict(2, [1.0, 2.0, 8.0, 16.0])
    assert np.all(pred > 0)
    assert pred[1] == pytest.approx(0.004)
    assert pred[2] == pytest.approx(0.016)  # through the origin: 4x the tokens, 4x the time
    assert cost.predict(64, [2.0])[0] > pred[1]  # a batch never measured borrows and scales by R


def test_shorter_blocks_than_measured_lie_on_the_line_from_no_draft_until_measured():
    """Warm-up at a large batch measured no draft (16 ms) and full blocks (t = 16: 100 ms)
    only. Shorter blocks lie on the straight line between the two: a one-token block at
    16 + 84 / 15 = 21.6 ms, above not drafting (a line through the origin, 100 * 2 / 16 =
    12.5 ms, made drafting look cheaper than not drafting), and below the full block's
    100 ms (priced like the full block, a short block never looked worth trying, so it was
    never measured); once measured, its own cost counts."""
    cost = StepCost(16, 64)
    for _ in range(10):
        cost.observe(64, 1.0, 0.016)
        cost.observe(64, 16.0, 0.100)
    pred = cost.predict(64, [1.0, 2.0, 8.0, 16.0])
    assert pred[0] == pytest.approx(0.016)
    assert pred[1] == pytest.approx(0.016 + 0.084 / 15) and pred[2] == pytest.approx(0.016 + 0.084 * 7 / 15)
    assert pred[3] == pytest.approx(0.100)
    for _ in range(10):
        cost.observe(64, 2.0, 0.060)
    pred = cost.predict(64, [2.0, 9.0])
    assert pred[0] == pytest.approx(0.060, rel=0.05)
    assert pred[1] == pytest.approx(0.080, rel=0.05)  # between the measured blocks: their line


def test_shorter_blocks_without_a_measured_no_draft_step_cost_the_shortest_measured_one():
    """Without t = 1 at that size there is no line to draw: the shortest measured block's
    cost, an upper bound (the cost does not fall below what is fixed per block)."""
    cost = StepCost(16, 64)
    for _ in range(10):
        cost.observe(64, 16.0, 0.100)
    pred = cost.predict(64, [2.0, 8.0, 16.0])
    assert pred == pytest.approx([0.100, 0.100, 0.100])
    for _ in range(10):  # t = 1 measured: the line appears (the cached row is refitted, not patched)
        cost.observe(64, 1.0, 0.016)
    assert cost.predict(64, [2.0])[0] == pytest.approx(0.016 + 0.084 / 15)


def test_outliers_are_clipped():
    cost = StepCost(4, 4)
    for _ in range(20):
        cost.observe(1, 1.0, 0.002)
    cost.observe(1, 1.0, 5.0)  # an idle gap
    assert cost.predict(1, [1.0])[0] < 0.002 * 1.2


def test_predict_before_data_and_bad_sizes_raise():
    with pytest.raises(RuntimeError, match="before any observation"):
        StepCost(4, 4).predict(1, [1.0])
    with pytest.raises(ValueError, match="must be >= 1"):
        StepCost(0, 4)


def test_no_draft_cost_borrows_from_sizes_that_measured_it():
    """Drafting at 8 requests measured only with a query block (t >= 2: ~10 ms), the
    context write alone (t = 1: ~1 ms) measured at 4 and 16 requests: the t = 1 cost
    at 8 comes from those sizes, not from the block line through the origin (5 ms)."""
    cost = StepCost(16, 16)
    for _ in range(50):
        cost.observe(4, 1.0, 0.8e-3)
        cost.observe(16, 1.0, 1.6e-3)
        for t in (2.0, 8.0, 16.0):
            cost.observe(8, t, 10e-3 + 0.1e-3 * t)
    pred = cost.predict(8, [1.0, 2.0, 16.0])
    assert pred[0] == pytest.approx(1.07e-3, rel=0.1)  # between 0.8 ms (R=4) and 1.6 ms (R=16)
    assert pred[1] == pytest.approx(10.2e-3, rel=0.05) and pred[2] == pytest.approx(11.6e-3, rel=0.05)


def test_no_draft_cost_beyond_measured_sizes_follows_the_two_token_step():
    """One request measured both regimes (no drafts 3 ms, t >= 2: 5 ms + 0.3 ms per token);
    eight requests only drafted (6 ms + 0.5 ms per token). Scaling the one-request no-draft
    step by R would price it at 24 ms, dearer than any draft; the one-request ratio
    no-draft / two-token step (3 / 5.6) applied to eight requests' own two-token step
    (7 ms) gives 3.75 ms."""
    cost = StepCost(16, 16)
    for _ in range(50):
        cost.observe(1, 1.0, 3e-3)
        for t in (2.0, 4.0, 8.0, 16.0):
            cost.observe(1, t, 5e-3 + 0.3e-3 * t)
            cost.observe(8, t, 6e-3 + 0.5e-3 * t)
    pred = cost.predict(8, [1.0, 2.0])
    assert pred[1] == pytest.approx(7e-3, rel=0.05)
    assert pred[0] == pytest.approx(3e-3 / 5.6e-3 * 7e-3, rel=0.05)


def test_smoothing_stays_within_the_neighbours_values():
    """A row from a noisy run (found by a random search): the straight line fitted to the
    last knot's neighbours, mostly below it, extrapolated to -4.7 ms and -5.6 ms. The
    pooled curve then went negative down to t = 2 and took the no-draft cost with it."""
    x = np.array([2.0, 3.0, 6.0, 8.0, 9.0, 13.0, 14.0])
    y = np.array([0.0737, 0.0022, 0.0011, 0.0033, 0.0042, 0.0002, 0.0032])
    w = np.array([3.71, 1.71, 1.0, 1.0, 1.0, 0.61, 1.0])
    smooth = local_linear(x, y, w, 3.0)
    assert (smooth >= y.min()).all() and (smooth <= y.max()).all(), smooth
    assert smooth[-1] >= min(y[-3:]), smooth  # 13 and 14 are its only neighbours with weight


def test_predicted_seconds_are_positive_under_heavy_noise():
    """Any positive measurements give positive, finite predictions at every size and
    block length: a cost <= 0 makes not drafting look infinitely fast or a plan's value
    negative. 300 random histories with lognormal noise up to sigma 1.5 (before the
    smoothing was bounded, 109 of 3000 such histories predicted a cost <= 0)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        cost = StepCost(16, 64, memory=float(rng.choice([20.0, 200.0])))
        for _ in range(int(rng.integers(1, 200))):
            r = int(rng.choice([1, 2, 3, 4, 8, 16, 32, 64]))
            t = float(rng.choice([1.0, 2.0, 1.0 + rng.integers(1, 16), 1.0 + 15.0 * rng.random()]))
            noise = float(np.exp(rng.normal(0.0, rng.choice([0.05, 0.5, 1.5]))))
            cost.observe(r, t, (3e-3 + 2e-4 * r) * (1.0 + 0.05 * r * t / 16) * noise)
        for r in (1, 2, 3, 5, 8, 17, 32, 64):
            pred = cost.predict(r, 1.0 + np.arange(15 * r + 1) / r)
            assert np.isfinite(pred).all() and (pred > 0).all(), (r, pred.min())


def test_not_ready_while_split_observations_leave_every_cell_short_of_min_weight():
    """One step at 5 requests (between the knots 4 and 6) and 2.5 tokens each splits its
    weight into four quarters, none reaching min_weight (0.5): no row has a curve, so the
    surface is not ready, and predict says so instead of failing inside the interpolation
    (it raised IndexError in a serving step). A third such step makes it ready (two quarters
    fall just short of a half: the older one has faded by its memory)."""
    c = StepCost(16, 64)
    c.observe(5, 2.5, 0.01)
    assert c.observations == 1 and not c.ready
    with pytest.raises(RuntimeError, match="check .ready"):
        c.predict(5, [1.0, 2.0])
    c.observe(5, 2.5, 0.01)
    assert not c.ready
    c.observe(5, 2.5, 0.01)
    assert c.ready
    assert c.predict(5, [1.0, 2.0]) == pytest.approx([0.01, 0.01])


def test_a_step_where_some_requests_verified_drafts_is_no_sample_of_the_no_draft_step():
    """At 4 requests, one verified draft makes 1.25 tokens a request: the step pays the
    drafting regime's fixed part (4.5 ms here against 2 ms without drafts). It weighs on
    t = 2 alone; split by distance, three quarters of it had gone to t = 1, and steps with
    a few verified drafts priced not drafting at most of a verifying step."""
    c = StepCost(16, 8)
    for _ in range(20):
        c.observe(4, 1.0, 2e-3)
        c.observe(4, 2.0, 5e-3)
    for _ in range(40):
        c.observe(4, 1.25, 4.5e-3)
    assert c.predict(4, [1.0])[0] == pytest.approx(2e-3, rel=1e-6)
    assert 4.5e-3 < c.predict(4, [2.0])[0] < 5e-3


def test_samples_of_steps_without_drafts_give_exactly_what_a_refit_gives():
    """A sample at t = 1 (a step that drafts nothing) updates a row's cached curve in place (the
    fit over t >= 2 does not read it) instead of refitting it: predictions equal those of a
    surface refitted from scratch after every sample, through rows that gain t = 1 evidence,
    rows without any t >= 2 evidence, samples between knots, and drafting samples mixed in."""
    rng = np.random.default_rng(3)
    cached, refitted = StepCost(8, 16), StepCost(8, 16)
    tokens = 1.0 + np.arange(8)
    for i in range(600):
        requests = int(rng.choice([1, 2, 3, 4, 5, 8, 12, 16]))
        t = 1.0 if rng.random() < 0.8 or i < 40 else float(rng.choice([1.5, 2.0, 3.5, 8.0]))
        seconds = 1e-3 * requests ** 0.5 * (1.0 + 0.3 * (t - 1.0)) * rng.lognormal(0.0, 0.2)
        for cost in (cached, refitted):
            cost.observe(requests, t, seconds)
        refitted.fold_queued()
        refitted._rows.clear()  # every row fitted afresh
        if cached.ready and i % 7 == 0:
            for r in (1, 3, 4, 9, 16):
                np.testing.assert_array_equal(cached.predict(r, tokens), refitted.predict(r, tokens))
    assert cached._fitted_rows  # the in-place path ran


def test_rows_with_unmeasured_short_blocks_keep_their_line_exact_under_samples_without_drafts():
    """The line from t = 1 (`_line_short_blocks`) follows every sample of a step without
    drafts in place, as a refit from scratch would draw it, through rows that gain t = 1
    before or after their first long block and rows that later measure a short one."""
    rng = np.random.default_rng(5)
    cached, refitted = StepCost(16, 16), StepCost(16, 16)
    tokens = 1.0 + np.arange(16) / 2
    lined_steps = 0
    for i in range(500):
        requests = int(rng.choice([2, 4, 8, 16]))
        u = rng.random()
        t = 1.0 if u < 0.85 else (16.0 if u < 0.95 or i < 300 else float(rng.choice([2.0, 5.0])))
        seconds = 1e-3 * requests ** 0.5 * (1.0 + 0.3 * (t - 1.0)) * rng.lognormal(0.0, 0.2)
        for cost in (cached, refitted):
            cost.observe(requests, t, seconds)
        refitted.fold_queued()
        refitted._rows.clear()
        if cached.ready and i % 5 == 0:
            for r in (2, 4, 6, 16):
                np.testing.assert_array_equal(cached.predict(r, tokens), refitted.predict(r, tokens))
            lined_steps += bool(cached._lined)
    assert lined_steps > 20  # rows were lined through many checks, and stayed exact in place

