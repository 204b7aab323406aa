"""Adaptive speculation, step by step: the proposer's one entry point.

Per propose() call (one engine step):

1. `begin(now, ...)`: the verification outcomes of the drafts handed out at
   the previous step arrive (per request id: positions verified, accepted)
   and train the shared acceptance model, each request's own shift of it
   (`calibration.RequestOffsets`) and the statistics; the wall time since
   the previous call ended is the step outside drafting, E(R, tokens), kept
   only for steady decode steps (the same requests, no prefill, so no idle
   gap or prompt is in it); then the controller plans q.
2. the proposer writes the context KV (always) and drafts q positions.
3. `choose(now, feature, prior)`: posterior survival of the drafts, per
   request budgets, remembered by request id for step 1 of the next call.
4. `end(now)`: the draft time D(R, q + 1) of this call.

Matching is by request id (rows move between steps); a request whose
outcome is missing (finished, preempted, its drafts trimmed by the
scheduler beyond what it was given) is simply not observed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_dflash.adaptive.calibration import GREEDY, SAMPLED, RequestOffsets
from vllm_dflash.adaptive.controller import BudgetController, ForcedSchedule, Plan
from vllm_dflash.adaptive.stats import AdaptiveStats


@dataclass
class _Pending:
    kind: int
    feature: np.ndarray  # [b] confidence feature of the positions handed out
    shared: np.ndarray  # [b] the shared model's conditional acceptance there (before the request's shift)
    survival: np.ndarray  # [b] predicted survival (with the shift): what the decision used


@dataclass
class StepState:
    t0: float
    req_ids: list[str]
    kinds: np.ndarray
    eligible: np.ndarray
    plan: Plan
    budgets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class AdaptiveSpeculation:
    def __init__(self, max_k: int, max_requests: int, seed: int = 0, schedule: str | None = None,
                 stats: AdaptiveStats | None = None, **controller_kwargs):
        self.max_k = max_k
        self.controller = BudgetController(max_k, max_requests, seed=seed, **controller_kwargs)
        self.schedule = ForcedSchedule(schedule, max_k, seed) if schedule else None
        self.stats = stats if stats is not None else AdaptiveStats(max_k)
        self.offsets = RequestOffsets()
        self._pending: dict[str, _Pending] = {}
        self._prev_req_ids: set[str] = set()
        self._prev_end: float | None = None
        self._step: StepState | None = None

    @property
    def acceptance(self):
        return self.controller.acceptance

    def begin(self, now: float, req_ids: list[str], num_verified: np.ndarray, num_accepted: np.ndarray,
              num_tokens: int, greedy: np.ndarray, eligible: np.ndarray) -> Plan:
        """Outcomes of the last drafts, the step-time sample, and this step's plan."""
        req_ids = list(req_ids)
        num_verified = np.asarray(num_verified, dtype=np.int64)
        num_accepted = np.asarray(num_accepted, dtype=np.int64)
        self._observe(req_ids, num_verified, num_accepted)
        requests = len(req_ids)
        steady = (self._prev_end is not None and requests > 0 and self._prev_req_ids.issuperset(req_ids)
                  and num_tokens == requests + int(num_verified.sum()))
        if steady:
            self.controller.step_cost.observe(requests, num_tokens / requests, now - self._prev_end)
        kinds = np.where(np.asarray(greedy, dtype=bool), GREEDY, SAMPLED)
        eligible = np.asarray(eligible, dtype=bool)
        planner = self.schedule or self.controller
        plan = planner.plan(req_ids, kinds)
        if not eligible.any():
            plan = Plan(0, plan.reason)
        self._step = StepState(now, req_ids, kinds, eligible, plan)
        return plan

    def _observe(self, req_ids: list[str], num_verified: np.ndarray, num_accepted: np.ndarray) -> None:
        rows = []
        for i, req_id in enumerate(req_ids):
            pending = self._pending.get(req_id)
            n = int(num_verified[i])
            if pending is None or n == 0 or n > pending.feature.shape[0]:
                continue
            rows.append((req_id, pending, n, int(num_accepted[i])))
        self._pending.clear()
        if not rows:
            return
        width = max(n for _, _, n, _ in rows)
        feature, shared, survival = (np.zeros((len(rows), width)) for _ in range(3))
        for r, (_, p, n, _) in enumerate(rows):
            feature[r, :n], shared[r, :n], survival[r, :n] = p.feature[:n], p.shared[:n], p.survival[:n]
        kinds = np.array([p.kind for _, p, _, _ in rows])
        verified = np.array([n for _, _, n, _ in rows])
        accepted = np.array([a for _, _, _, a in rows])
        self.controller.acceptance.update(kinds, feature, verified, accepted)
        pos = np.arange(width)[None, :]
        self.offsets.update([r for r, _, _, _ in rows], shared, pos < np.minimum(accepted + 1, verified)[:, None],
                            pos < accepted[:, None])
        self.stats.record_outcomes(survival, verified, accepted)

    def choose(self, now: float, feature: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """[R] budgets for drafts with confidence `feature` [R, q] (standing for
        probabilities `prior`); D so far is now - begin's time."""
        st = self._step
        feature = np.asarray(feature, dtype=np.float64)
        if feature.shape[1] == 0:  # nothing drafted this step
            st.budgets = np.zeros(len(st.req_ids), dtype=np.int64)
            return st.budgets
        shared = self.controller.acceptance.conditional(st.kinds, feature, prior)
        survival = np.cumprod(self.offsets.apply(st.req_ids, shared), axis=1)
        planner = self.schedule or self.controller
        budgets = planner.budgets(st.plan, survival, now - st.t0, st.eligible)
        budgets = np.where(st.eligible, np.minimum(budgets, feature.shape[1]), 0)
        st.budgets = budgets
        self.controller.prior.record([r for r, e in zip(st.req_ids, st.eligible) if e],
                                     st.kinds[st.eligible], survival[st.eligible])
        for i, req_id in enumerate(st.req_ids):
            b = int(budgets[i])
            if b > 0:
                self._pending[req_id] = _Pending(int(st.kinds[i]), feature[i, :b].copy(), shared[i, :b].copy(),
                                                 survival[i, :b].copy())
        return budgets

    def end(self, now: float) -> None:
        """The call is over: D(R, q + 1) sample, statistics of the step."""
        st = self._step
        if st is None:
            return
        requests = len(st.req_ids)
        if requests:
            self.controller.draft_cost.observe(requests, st.plan.q + 1, now - st.t0)
        self.stats.record_step(st.plan.q, st.budgets[st.eligible] if st.budgets.size else
                               np.zeros(int(st.eligible.sum()), dtype=np.int64), st.plan.reason)
        self.controller.prior.forget(st.req_ids)
        self.offsets.forget(st.req_ids)
        self._prev_req_ids = set(st.req_ids)
        self._prev_end = now
        self._step = None
