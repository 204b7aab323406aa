"""choose() for a few requests in Python floats decides exactly as the numpy path does."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from vllm_dflash.adaptive import speculation
from vllm_dflash.adaptive.controller import OPTIMAL, PROBE, Plan
from vllm_dflash.adaptive.speculation import AdaptiveSpeculation

K = 15


def learned_spec(seed: int) -> AdaptiveSpeculation:
    """A controller with every learned part away from its start: acceptance tables from
    outcomes, per-request shifts (some zero), the per-position correction and its gain,
    and a step cost where verifying costs about what a token yields (budgets in between)."""
    rng = np.random.default_rng(seed)
    spec = AdaptiveSpeculation(K, 8, seed=seed, warmup_steps=0, knot_warmup_steps=0)
    c = spec.controller
    for r in (1, 2, 3, 4):
        for t in range(1, K + 2):
            c.step_cost.observe(r, t, 5e-3 * (1.0 + 0.15 * r * (t - 1)) * float(np.exp(rng.normal(0, 0.05))))
            c.draft_cost.observe(r, t, 1e-3)
    n = 400
    feature = rng.random((n, K))
    verified = rng.integers(1, K + 1, n)
    accepted = np.minimum(rng.geometric(0.25, n) - 1, verified)
    c.acceptance.update(rng.integers(0, 2, n), feature, verified, accepted)
    raw = np.cumprod(rng.uniform(0.5, 1.0, (n, K)), axis=1)
    spec.correction.update(raw, verified, accepted)
    spec.offsets.update(["a", "b"], rng.uniform(0.2, 0.9, (2, K)), np.ones((2, K), bool), rng.random((2, K)) < 0.7)
    return spec


def choose_both(spec, monkeypatch, req_ids, kinds, feature, prior, useful, reason, flat_cost=False):
    """The same step chosen on both paths from the same state: (few-requests, numpy) results.
    `flat_cost`: verifying costs nothing extra (values tie wherever a pair adds nothing)."""
    out = []
    for pairs in (speculation.MAX_PAIRS, 0):
        s = copy.deepcopy(spec)
        if flat_cost:
            s.controller.step_curve = lambda requests, width: np.full(requests * width + 1, 5e-3)
        n = len(req_ids)
        s.begin(0.0, req_ids, np.zeros(n, np.int64), np.zeros(n, np.int64), n, kinds == 0, np.ones(n, bool),
                useful=useful)
        s._step.plan = Plan(feature.shape[1], reason)
        s._step.kinds = kinds
        monkeypatch.setattr(speculation, "MAX_PAIRS", pairs)
        budgets = s.choose(0.002, feature, prior)
        h = s._handed
        out.append((budgets, h.shared, h.raw, h.survival, s._step.expected_accepted, s._drafted[-1][2]))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_few_requests_path_gives_the_numpy_paths_budgets_and_survival(seed, monkeypatch):
    """400 random steps per seed: one to four requests, one to 15 drafted positions, mixed
    kinds, requests with and without a shift, capped by what a request can still use or
    not, ties in confidence and in value (free verification, positions a request cannot
    use). Budgets equal exactly, survival to rounding."""
    spec = learned_spec(seed)
    rng = np.random.default_rng(100 + seed)
    chose_between = 0
    for _ in range(400):
        rows = int(rng.integers(1, 5))
        width = int(rng.integers(1, K + 1))
        req_ids = [str(x) for x in rng.choice(["a", "b", "c", "d", "e"], rows, replace=False)]
        kinds = rng.integers(0, 2, rows)
        feature = rng.random((rows, width)).astype(np.float32)
        if rng.random() < 0.2:
            feature[:] = feature[0, 0]  # ties everywhere
        prior = rng.random((rows, width)).astype(np.float32)
        useful = rng.integers(0, K + 1, rows) if rng.random() < 0.5 else None
        few, ref = choose_both(spec, monkeypatch, req_ids, kinds, feature, prior, useful,
                               OPTIMAL if rng.random() < 0.8 else PROBE, flat_cost=rng.random() < 0.2)
        assert few[0].tolist() == ref[0].tolist()
        for a, b in zip(few[1:4] + few[5:], ref[1:4] + ref[5:]):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
        assert few[4] == pytest.approx(ref[4], rel=1e-12)
        chose_between += int(0 < few[0].sum() < rows * width)
    assert chose_between > 100  # the budgets were decisions, not all-or-nothing


def test_few_requests_path_runs_only_where_it_applies(monkeypatch):
    """Warm-up and exploration draw random budgets, a forced schedule keeps its own,
    partial prefills get none, and a block past MAX_PAIRS goes to numpy: all of those
    take the numpy path (a spy on the controller's budgets sees them)."""
    spec = learned_spec(0)
    calls = []
    original = spec.controller.budgets
    spec.controller.budgets = lambda *a, **k: calls.append(1) or original(*a, **k)

    def run(reason, eligible=(True, True), rows=2):
        spec.begin(0.0, ["a", "b", "c", "d", "e"][:rows], np.zeros(rows, np.int64), np.zeros(rows, np.int64), rows,
                   np.ones(rows, bool), np.array(eligible[:rows]) if rows == 2 else np.ones(rows, bool))
        spec._step.plan = Plan(K, reason)
        f = np.full((rows, K), 0.7, dtype=np.float32)
        spec.choose(0.001, f, f)
        spec.end(0.002)
        return len(calls)

    assert run(OPTIMAL) == 0 and run(PROBE) == 0
    assert run("explore") == 1 and run("warmup") == 2
    assert run(OPTIMAL, eligible=(True, False)) == 3
    assert run(OPTIMAL, rows=5) == 4  # 5 x 15 pairs > MAX_PAIRS
