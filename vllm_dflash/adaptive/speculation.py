"""Adaptive speculation, step by step: the proposer's one entry point.

Per propose() call (one engine step):

1. `begin(now, ...)`: the verification outcomes of the drafts handed out at
   the previous step arrive (per request id: positions verified, accepted)
   and go to the statistics, and (batched, `learn`) to the shared acceptance
   model, each request's own shift of it (`calibration.RequestOffsets`) and
   the per-position correction (`calibration.SurvivalCorrection`); the wall time since
   the previous call ended is the step outside drafting, E(R, tokens), kept
   only for steady decode steps (the same requests, no prefill, so no idle
   gap or prompt is in it); then the controller plans q.
2. the proposer writes the context KV (always) and drafts q positions.
3. `choose(now, feature, prior)`: posterior survival of the drafts (with
   the per-position calibration in the large, `SurvivalCorrection`), per
   request budgets, remembered (by request id) for step 1 of the next call.
4. `end(now)`: the draft time D(R, q + 1) of this call.

Matching is by request id (rows move between steps); a request whose
outcome is missing (finished, preempted, its drafts trimmed by the
scheduler beyond what it was given) is simply not observed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_dflash.adaptive.calibration import GREEDY, SAMPLED, RequestOffsets, SurvivalCorrection
from vllm_dflash.adaptive.controller import (EXPLORE, FORCED, OFF_EPOCH, OPTIMAL, PROBE, BudgetController, ForcedSchedule,
                                             Plan)
from vllm_dflash.adaptive.few_requests import MAX_PAIRS, few_requests_choice
from vllm_dflash.adaptive.realized import NEW_TEXT_KEEP, SpeedIndex
from vllm_dflash.adaptive.stats import AdaptiveStats

# Learning waits for LEARN_ROWS queued rows, drafts and outcomes (or 4 x learn_every steps): at one
# request, learning every 4 steps cost ~0.1 ms a step (0.4 ms a call, float32, bundled pair).
LEARN_ROWS = 16
# Steps of a run (coasting, or drafting on a cached plan) logged before they are folded in (at most:
# a changed batch, a prompt chunk or a step that plans folds at once). With 64 for coasting runs (fewer
# folds and slow first steps, ~0.1 ms each at 8 requests) the benches on c699692 / 6ec3171 had one
# request coast through whole code requests in some rounds, and static k = 15 at one request went
# 1.02x -> 0.89x (float32, AVX-512 EPYC); the checks made at a run's start came 4x less often there.
# Back at 16 for both kinds until a bench says otherwise.
RUN_STEPS = 16


@dataclass
class _Handed:
    """What a step handed out, kept until the next step reports its outcome."""

    req_ids: list[str]  # the step's requests, by row
    kinds: np.ndarray  # [R]
    feature: np.ndarray  # [R, q] confidence feature of the drafts
    shared: np.ndarray  # [R, q] the shared model's conditional acceptance (before each request's shift)
    raw: np.ndarray  # [R, q] predicted survival with the shift, before the per-position correction
    survival: np.ndarray  # [R, q] corrected survival: what the decision used
    budgets: np.ndarray  # [R]


@dataclass
class StepState:
    t0: float
    req_ids: list[str]
    kinds: np.ndarray
    eligible: np.ndarray
    plan: Plan
    budgets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    expected_accepted: float = 0.0  # drafts the budgets were expected to have accepted
    useful: np.ndarray | None = None  # [R] the most drafts each request can still use (None: any)
    in_run: bool = False  # a step of a drafting run: its samples are logged for `fold_runs`


def _stack_padded(arrays: list[np.ndarray], width: int) -> np.ndarray:
    """Rows of 2-D arrays of different widths, zero-padded to `width` (np.pad is slow on small arrays)."""
    out = np.zeros((sum(a.shape[0] for a in arrays), width))
    row = 0
    for a in arrays:
        out[row:row + a.shape[0], :a.shape[1]] = a
        row += a.shape[0]
    return out


class AdaptiveSpeculation:
    """See the module docstring. Learning (the acceptance model, request shifts,
    survival prior) is folded in every `learn_every` steps (with at least
    `LEARN_ROWS` outcomes queued, or after 4x as many steps) in one batch: the
    models move slowly, and a step's own bookkeeping must stay cheap; the
    statistics are counted every step."""

    def __init__(self, max_k: int, max_requests: int, seed: int = 0, schedule: str | None = None,
                 stats: AdaptiveStats | None = None, learn_every: int = 4, measure_first_calls: bool = False,
                 **controller_kwargs):
        self.max_k = max_k
        self.measure_first_calls = measure_first_calls  # (tests of the cycle accounting itself)
        self.controller = BudgetController(max_k, max_requests, seed=seed, **controller_kwargs)
        self.schedule = ForcedSchedule(schedule, max_k, seed) if schedule else None
        self.stats = stats if stats is not None else AdaptiveStats(max_k)
        self.offsets = RequestOffsets()
        self.controller.request_shifts = self.offsets.shifts  # plans continue each request's own advantage
        self.correction = SurvivalCorrection(max_k)
        self.speed = SpeedIndex()  # samples enter the cost curves in the units of a steady machine
        self.learn_every = learn_every
        self._handed: _Handed | None = None
        self._outcomes: list[tuple] = []  # (req_ids, kinds, feature, shared, verified, accepted, raw)
        self._drafted: list[tuple] = []  # (req_ids, kinds, survival), queued for the prior
        self._steps_since_learning = 0
        self._queued_rows = 0  # drafted rows and verified outcomes queued for learn()
        self._prev_req_ids: set[str] = set()
        self._prev_req_list: list[str] = []
        # Steps of the open run (coasting, or drafting on a cached plan): [start, scheduled tokens,
        # accepted drafts] from begin(), extended by end() with [end, not drafting, verified budget,
        # expected accepted drafts] (coast() and end_coast() log all seven at once).
        self._run_log: list[list] = []
        self._run_left = 0  # further steps the open run may take
        self._run_q = 0  # its plan (0: coasting)
        self._run_opening: tuple[bool, bool, int] | None = None  # a coasting run opened by a batch change
        self._prev_end: float | None = None
        # (q, forecast drafting and step seconds, drafting seconds in the speed index's units, expected
        # accepted drafts, requests, drafting seconds as measured, seconds of the call that were not
        # drafting: held context and prompt rows written) of the last call
        self._prev_cycle: tuple[int, float, float, float, float, int, float, float] | None = None
        self._drafted_before: bool | None = None  # whether the cycle before _prev_cycle drafted
        self._drafted_shapes: set[tuple[int, int]] = set()  # (requests, q) drafted before (`_close_cycle`)
        self._step: StepState | None = None
        self._period_clock: float | None = None  # when the last step began (`_count_period`)

    @property
    def acceptance(self):
        return self.controller.acceptance

    def begin(self, now: float, req_ids: list[str], num_verified: np.ndarray, num_accepted: np.ndarray,
              num_tokens: int, greedy: np.ndarray, eligible: np.ndarray, useful: np.ndarray | None = None) -> Plan:
        """Outcomes of the last drafts, the step-time sample, and this step's plan. `useful`:
        per request the most drafts its next step can still turn into output (a request stops
        at its token limit: drafts past it would be verified for nothing); None: no limit.

        A steady step (the same requests in the same rows, plain decode plus the verified
        drafts, every request eligible) whose batch size's cached plan drafts and holds
        (`BudgetController.steady_run`) takes that plan without planning; its samples are
        logged and folded with the rest of its run (`fold_runs`). Measured in the engine at
        one request (float32, bundled pair): planning and sampling step by step cost
        ~0.25 ms of a ~9 ms drafting step; static speculation pays nothing of the kind."""
        req_ids = req_ids if type(req_ids) is list else list(req_ids)  # the proposer's is a fresh slice
        num_verified = np.asarray(num_verified, dtype=np.int64)
        num_accepted = np.asarray(num_accepted, dtype=np.int64)
        eligible = np.asarray(eligible, dtype=bool)
        requests = len(req_ids)
        plain_decode = num_tokens == requests + int(num_verified.sum())  # no prompt chunk in the step
        steady_same = (self.schedule is None and req_ids == self._prev_req_list and self._prev_end is not None
                       and plain_decode and bool(eligible.all()))
        if not (steady_same and self._run_left > 0):
            self.fold_runs()
        self._observe(req_ids, num_verified, num_accepted)
        kinds = np.where(np.asarray(greedy, dtype=bool), GREEDY, SAMPLED)
        useful = None if useful is None else np.asarray(useful, dtype=np.int64)
        if steady_same:
            if self._run_left == 0:
                self._run_left, self._run_q = self.controller.steady_run(req_ids, RUN_STEPS, drafting=True)
            if self._run_left > 0:
                self._run_left -= 1
                self._run_log.append([now, num_tokens, int(num_accepted.sum())])
                plan = Plan(self._run_q, OPTIMAL)
                self._step = StepState(now, req_ids, kinds, eligible, plan, useful=useful, in_run=True)
                return plan
        same_or_fewer = req_ids == self._prev_req_list or self._prev_req_ids.issuperset(req_ids)
        steady = same_or_fewer and plain_decode
        fresh = not same_or_fewer and self._prev_req_ids.isdisjoint(req_ids)
        self._learn_and_sample(now, requests, num_tokens, steady, int(num_accepted.sum()), same_or_fewer, fresh)
        if fresh and self._prev_req_ids:  # new text: the arms and yields measured other requests (`ArmRates`)
            self.controller.arms.discount(requests, NEW_TEXT_KEEP)
            self.controller.realized.discount_yields(requests, NEW_TEXT_KEEP)
        planner = self.schedule or self.controller
        plan = planner.plan(req_ids, kinds)
        if not eligible.any():
            plan = Plan(0, plan.reason)
        self._step = StepState(now, req_ids, kinds, eligible, plan, useful=useful)
        return plan

    def coast(self, now: float, req_ids: list[str], num_tokens: int, all_greedy: bool = False) -> bool:
        """begin() for the commonest step where speculation does not pay: one that verified
        nothing and drafts nothing again (`BudgetController.steady_run`), with the same
        requests as the last step or after a batch change (`_batch_change`, which opens a
        run of its own). Nothing is planned or sampled now: the step
        is logged and, with the rest of its run, folded in later (`fold_runs`). True:
        end the step with end_coast(). False: nothing was done; call begin().

        Measured in the engine (float32, 32 requests), the same bookkeeping done step by
        step cost 0.1 ms a step, against 16 us in a loop: between target forwards the
        step's Python runs cold. A run of `RUN_STEPS` steps is folded in one warm loop.
        `all_greedy`: every request is greedy (a cached plan then carries over to other
        requests of its basis, `BudgetController.steady_run`)."""
        requests = len(req_ids)
        if self._run_left > 0:
            if self.coasting_run(num_tokens) == req_ids:
                self._run_left -= 1
                return True
            if self._run_q > 0 or self.schedule is not None:
                return False  # a drafting run, or a forced one: begin() continues or ends it
        self.fold_runs()
        if self._handed is not None or self._prev_end is None:
            return False
        opening = None
        if num_tokens != requests or req_ids != self._prev_req_list:
            opening = self._batch_change(req_ids, num_tokens)
            if opening is None:
                return False
        kinds = np.full(requests, GREEDY, dtype=np.int64) if all_greedy else None
        run, _ = (self.schedule or self.controller).steady_run(req_ids, RUN_STEPS, kinds=kinds)
        if run == 0:
            return False
        self._run_left, self._run_q = run - 1, 0
        if opening is not None:
            self._run_opening = opening
            self._remember_batch(req_ids)
        return True

    def _batch_change(self, req_ids: list[str], num_tokens: int) -> tuple[bool, bool, int] | None:
        """(steady, same_or_fewer, scheduled tokens) of a step whose batch changed (requests
        finished, or a prompt chunk came in) for `_learn_and_sample`, where such a step may
        open a coasting run: begin() would learn the same from it, and plan nothing new where
        the batch size's cached plan (`steady_run`) holds no drafts. None: begin() takes it
        (a forced schedule, or only new requests: the engine may have idled, `_count_period`).

        At 16 requests in flight (64-token requests, bfloat16, Xeon with AMX) a sixth of the
        steps changed the batch, and each took the planning path at ~0.75 ms against ~0.06 ms
        for a coasting step: ~2.5% of every step, most of what adaptive speculation still cost
        where it drafted nothing."""
        if self.schedule is not None or not req_ids:
            return None
        same_or_fewer = self._prev_req_ids.issuperset(req_ids)
        if not same_or_fewer and self._prev_req_ids.isdisjoint(req_ids):
            return None
        return same_or_fewer and num_tokens == len(req_ids), same_or_fewer, num_tokens

    def coasting_run(self, num_tokens: int) -> list[str] | None:
        """The requests of the open coasting run if a plain-decode step of theirs with
        `num_tokens` scheduled tokens continues it (coast() would return True at once),
        else None. Nothing changes: `coast_on` takes the step."""
        if self._run_left > 0 and self._run_q == 0 and num_tokens == len(self._prev_req_list):
            return self._prev_req_list
        return None

    def coast_on(self, start: float, now: float, not_drafting: float = 0.0) -> None:
        """coast() and end_coast() at once, for a step `coasting_run` said continues the run."""
        self._run_left -= 1
        self.end_coast(start, now, not_drafting)

    def end_coast(self, start: float, now: float, not_drafting: float = 0.0) -> None:
        """end() of a step coast() took at `start`: counted in the statistics now (metrics and
        bench cells read them while the engine idles), its time samples logged for `fold_runs`."""
        requests = len(self._prev_req_list)
        self.stats.record_no_drafts(requests, FORCED if self.schedule is not None
                                    else OFF_EPOCH if self.controller.epochs.off_now else OPTIMAL)
        self._run_log.append([start, requests, 0, now, not_drafting, 0, 0.0])

    def fold_runs(self) -> None:
        """The logged steps of a coasting or drafting run, in order, as begin(), choose()
        and end() would have taken them one by one: step-time samples E(R, t) and
        D(R, q + 1), the cycles' realised time and tokens. Called before any step that
        is not part of the run (a run's last steps wait for it)."""
        log, self._run_log = self._run_log, []
        opening, self._run_opening = self._run_opening, None
        if self._run_left > 0:
            self.controller.run_cut_short()
        self._run_left = 0
        if not log:
            return
        if len(log[-1]) < 7:  # a step that began and never ended (its call failed): no sample
            log.pop()
        req_ids = self._prev_req_list
        requests, q, controller = len(req_ids), self._run_q, self.controller
        forced = self.schedule is not None  # a forced plan has no forecast (end())
        for i, (start, num_tokens, accepted, end, not_drafting, budget, expected) in enumerate(log):
            steady = same_or_fewer = True
            if i == 0 and opening is not None:  # the run's first step changed the batch (`_batch_change`)
                steady, same_or_fewer, num_tokens = opening
            self._learn_and_sample(start, requests, num_tokens, steady=steady, accepted=accepted,
                                   same_or_fewer=same_or_fewer)
            parts = (0.0, 0.0) if forced else controller.forecast_parts(requests, q, budget)
            self._close_cycle(start, end, not_drafting, requests, q, parts, expected)
            controller.prior.forget(req_ids)  # step by step: learning inside the loop stamps rows with it
        (self.schedule or controller).coasted(len(log))
        self.offsets.forget(req_ids)

    def _learn_and_sample(self, now: float, requests: int, num_tokens: int, steady: bool, accepted: int = 0,
                          same_or_fewer: bool = True, fresh: bool = False) -> None:
        """Every step: the batched learning when due; on a steady step (the same or fewer
        requests, plain decode plus the verified drafts) the E(R, tokens) sample; and on
        every step the realised/forecast time of the cycle that ends here and the tokens
        it yielded (one per request plus the `accepted` drafts) against those expected.

        A cycle whose step carried a prompt chunk, or whose batch changed, is forecast
        again for what it ran: the step outside drafting at this step's requests and
        scheduled tokens, prompt tokens priced like verified drafts. In-flight batching
        at many requests puts a new request's prompt into most steps once speculation
        has put requests out of step; learning from steady cycles only, the factors
        never saw the cycles where drafting lost (measured: 32 requests drafting at
        0.6x the tokens per second of not drafting, for as long as prompts kept coming)."""
        self._steps_since_learning += 1
        since = self._steps_since_learning
        if since >= self.learn_every and (self._queued_rows >= LEARN_ROWS or since >= 4 * self.learn_every):
            self.learn()
        self._count_period(now, requests, num_tokens, accepted, fresh, steady)
        if self._prev_end is None or requests == 0:
            return
        # Seconds in the curves' units: divided by how fast the machine runs now (`SpeedIndex`).
        outside = measured_outside = now - self._prev_end
        if self._switched_kind():
            if steady:
                self._charge_switch_to_drafting(requests, accepted, measured_outside)
            return
        if steady:
            predicted = self.controller.step_seconds(requests, num_tokens, cached_only=True)
            if predicted > 0:  # the index follows the steps (most of them) a cached plan predicts
                self.speed.observe(outside, predicted)
        outside /= self.speed.factor
        if steady:
            self.controller.step_cost.observe(requests, num_tokens / requests, outside)
        if self._prev_cycle is None:
            return
        q, draft_forecast, step_forecast, drafting, expected_accepted, prev_requests, measured_drafting, _ = self._prev_cycle
        if draft_forecast + step_forecast <= 0:  # a forced or warm-up plan: no forecast
            return
        if not (steady and prev_requests == requests):
            if num_tokens > requests * (self.max_k + 1):  # past the measured curves: an extrapolation
                return
            step_forecast = self.controller.step_seconds(requests, num_tokens)
            # New requests after the engine waited for work: the gap is idle time, not the step's.
            if step_forecast <= 0 or (not same_or_fewer and outside > 3.0 * step_forecast):
                return
        self.controller.realized.observe(requests, q > 0, draft_forecast + step_forecast, drafting + outside,
                                         requests + expected_accepted, requests + accepted)
        # The arms in measured seconds: the speed index follows the curves' predictions, so a kind of step
        # they predict short would move it, and in its units look faster than it ran (measured: drafting at
        # 8 requests 20% ahead of not drafting in index units while it delivered 15-20% less).
        self.controller.arms.observe(requests, q > 0, measured_drafting + measured_outside, requests + accepted)

    def _charge_switch_to_drafting(self, requests: int, accepted: int, measured_outside: float) -> None:
        """The first drafting cycle after cycles without drafts reaches the drafting arm whole,
        with the context its drafting call wrote for the steps that held it back
        (`serving.context_queue`), which no other cycle carries: left out of D(R, q + 1) (a decode
        step's own cost) and of every arm, that write was paid by nobody in the comparison, so
        drafting looked ahead where each return to it cost more than it gained. Measured at 8
        requests on prose (float32, AVX-512 EPYC): the arms put drafting 1.04-1.29x ahead of not
        drafting while engines drafting 5-69% of steps ran 0.83-0.88x of one without speculation;
        written at ~25 us a row, the held context of a 16-request batch costs ~0.4 ms per step
        held, ~5% of its step. Not a sample of the curves or the realised factors: those price a
        step, and `switch_pays` prices the write itself when the plan turns drafting on."""
        q, *_, prev_requests, measured_drafting, held = self._prev_cycle
        if q > 0 and prev_requests == requests:
            self.controller.arms.observe(requests, True, measured_drafting + held + measured_outside, requests + accepted)

    def _switched_kind(self) -> bool:
        """The cycle that ends at this step drafted and the one before it did not, or the other
        way round. Such a cycle is no sample of either kind: the time outside drafting runs
        from the end of the last drafting call, so it holds the rest of the step before
        (vLLM's bookkeeping and output of that step's tokens, which the kind before produced).
        Traced at 4 requests (bfloat16, bundled pair, AVX-512 EPYC): no-draft steps right after
        drafting measured 2.35 ms outside drafting against ~1.95 ms for no-draft steps in a row,
        and the no-draft arm 1386 tok/s where an engine without speculation ran ~2100: drafting
        looked 1.6x ahead and ran level with not drafting."""
        cycle = self._prev_cycle
        return cycle is not None and self._drafted_before is not None and (cycle[0] > 0) != self._drafted_before

    def _count_period(self, now: float, requests: int, num_tokens: int, accepted: int, fresh: bool,
                      plain: bool) -> None:
        """This step in the busy period's sums (`drain.DrainLoss`) and the policy epochs: its
        seconds since the last step began, its tokens, and whether the cycle drafted (`plain`:
        no prompt chunk in the step; the epochs leave such a step out of their rates). A step of only new requests
        after a gap longer than its own forward could take (the engine idled) closes the
        period before it and opens one; the gap is no step's time."""
        last, self._period_clock = self._period_clock, now
        if last is None or requests == 0:
            return
        drain = self.controller.drain
        if fresh:
            # A prompt step's forward, priced past the curves' last knot in proportion to its tokens.
            widest = requests * (self.max_k + 1)
            forecast = self.controller.step_seconds(requests, num_tokens) * max(1.0, num_tokens / widest)
            if forecast <= 0 or self._prev_end is None or now - self._prev_end > 3.0 * forecast:
                drain.end_period()
                self.controller.epochs.abort()
                return
        drafted = self._prev_cycle is not None and self._prev_cycle[0] > 0
        drain.step(requests, drafted, now - last, requests + accepted)
        self.controller.epochs.step(requests, drafted, now - last, requests + accepted, plain)

    def _observe(self, req_ids: list[str], num_verified: np.ndarray, num_accepted: np.ndarray) -> None:
        """Match this step's verification outcomes to what the last step handed out, by request id."""
        handed, self._handed = self._handed, None
        if handed is None or not req_ids:
            return
        if req_ids == handed.req_ids:  # the usual decode step: the same requests in the same rows
            ok = (num_verified > 0) & (num_verified <= handed.budgets)
            if ok.all():  # every row as handed out: no row selection (each numpy call counts here)
                self._queue_outcomes(req_ids, handed, num_verified, num_accepted)
                return
            prev = np.arange(len(req_ids))
        else:
            row_of = {r: i for i, r in enumerate(handed.req_ids)}
            prev = np.fromiter((row_of.get(r, -1) for r in req_ids), np.int64, len(req_ids))
            known = prev >= 0
            ok = known & (num_verified > 0)
            # trimmed drafts are fine, longer ones not ours
            ok[known] &= num_verified[known] <= handed.budgets[prev[known]]
        if not ok.any():
            return
        rows = prev[ok]
        ids = req_ids if ok.all() else [r for r, good in zip(req_ids, ok) if good]
        selected = _Handed(ids, handed.kinds[rows], handed.feature[rows], handed.shared[rows], handed.raw[rows],
                           handed.survival[rows], handed.budgets[rows])
        self._queue_outcomes(ids, selected, num_verified[ok], num_accepted[ok])

    def _queue_outcomes(self, req_ids: list[str], handed: _Handed, verified: np.ndarray,
                        accepted: np.ndarray) -> None:
        """Count the verified drafts `handed` (their rows, in order) in the statistics and queue them for learn()."""
        self.stats.record_outcomes(handed.survival, verified, accepted)
        self._outcomes.append((req_ids, handed.kinds, handed.feature, handed.shared, verified, accepted, handed.raw))
        self._queued_rows += len(req_ids)

    def learn(self) -> None:
        """Fold the queued outcomes and drafts into the models."""
        self._steps_since_learning = self._queued_rows = 0
        if self._outcomes:
            queued, self._outcomes = self._outcomes, []
            width = max(q[2].shape[1] for q in queued)
            req_ids = [r for q in queued for r in q[0]]
            kinds = np.concatenate([q[1] for q in queued])
            feature, shared = _stack_padded([q[2] for q in queued], width), _stack_padded([q[3] for q in queued], width)
            verified = np.concatenate([q[4] for q in queued])
            accepted = np.concatenate([q[5] for q in queued])
            self.controller.acceptance.update(kinds, feature, verified, accepted)
            self.correction.update(_stack_padded([q[6] for q in queued], width), verified, accepted)
            pos = np.arange(width)[None, :]
            self.offsets.update(req_ids, shared, pos < np.minimum(accepted + 1, verified)[:, None],
                                pos < accepted[:, None])
        if self._drafted:
            queued, self._drafted = self._drafted, []
            for req_ids, kinds, survival in queued:
                self.controller.prior.record(req_ids, kinds, survival)

    def choose(self, now: float, feature: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """[R] budgets for drafts with confidence `feature` [R, q] (standing for
        probabilities `prior`); D so far is now - begin's time."""
        st = self._step
        feature = np.asarray(feature, dtype=np.float64)
        if feature.shape[1] == 0:  # nothing drafted this step
            st.budgets = np.zeros(len(st.req_ids), dtype=np.int64)
            return st.budgets
        rows, width = feature.shape
        if (rows * width <= MAX_PAIRS and width <= self.max_k and self.schedule is None
                and st.plan.reason in (OPTIMAL, PROBE) and st.eligible.all()):
            return self._choose_few(now, feature, prior)
        shared = self.controller.acceptance.conditional(st.kinds, feature, prior)
        raw = np.cumprod(self.offsets.apply(st.req_ids, shared), axis=1)
        # Budgets are chosen on the calibration's upper bounds (rarely verified positions get
        # the benefit of the doubt until they are measured); survival itself, the estimate,
        # is what is recorded, learned from and expected.
        survival, optimistic = self.correction.estimate_and_bound(raw)
        planner = self.schedule or self.controller
        # Positions a request cannot use are worth nothing to the budget choice (a forced test
        # schedule keeps its own lengths); the models still learn from the drafts' survival.
        capped = st.useful is not None and self.schedule is None
        if capped:
            usable = np.arange(width)[None, :] < st.useful[:, None]
            optimistic = np.where(usable, optimistic, 0.0)
        budgets = planner.budgets(st.plan, optimistic, now - st.t0, st.eligible)
        budgets = np.where(st.eligible, np.minimum(budgets, np.minimum(st.useful, width) if capped else width), 0)
        st.budgets = budgets
        expected = 0.0
        if budgets.any():  # survival summed over each request's budget: its expected accepted drafts
            rows = np.flatnonzero(budgets)
            cumulative = np.cumsum(survival[rows], axis=1)
            expected = float(cumulative[np.arange(rows.size), budgets[rows] - 1].sum())
        return self._hand_out(feature, shared, raw, survival, budgets, expected)

    def _choose_few(self, now: float, feature: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """choose() for a block of at most `MAX_PAIRS` pairs, every request eligible, on a
        plan that is neither warm-up nor exploration: the same chain in Python floats
        (`few_requests`)."""
        st, controller, acceptance = self._step, self.controller, self.controller.acceptance
        rows, width = feature.shape
        scales, upper = self.correction.scale_lists()
        shared, raw, survival, budgets, expected = few_requests_choice(
            st.kinds.tolist(), feature.tolist(), np.asarray(prior).tolist(), acceptance.table_lists(),
            acceptance.num_bins, acceptance.num_positions, self.offsets.shift_list(st.req_ids), scales, upper,
            None if st.useful is None else st.useful.tolist(), controller.step_curve(rows, width).tolist(),
            now - st.t0)
        return self._hand_out(feature, np.array(shared), np.array(raw), np.array(survival),
                              np.array(budgets, dtype=np.int64), expected)

    def _hand_out(self, feature: np.ndarray, shared: np.ndarray, raw: np.ndarray, survival: np.ndarray,
                  budgets: np.ndarray, expected_accepted: float) -> np.ndarray:
        """The step's chosen budgets, whichever path chose them: kept for end() and for the
        next step's outcomes, the eligible rows' survival queued for the prior."""
        st = self._step
        st.budgets, st.expected_accepted = budgets, expected_accepted
        if st.eligible.all():
            self._drafted.append((st.req_ids, st.kinds, survival))
        else:
            self._drafted.append(([r for r, e in zip(st.req_ids, st.eligible) if e], st.kinds[st.eligible],
                                  survival[st.eligible]))
        self._queued_rows += len(self._drafted[-1][0])
        self._handed = _Handed(st.req_ids, st.kinds, feature, shared, raw, survival, budgets)
        return budgets

    def end(self, now: float, not_drafting: float = 0.0) -> None:
        """The call is over: D(R, q + 1) sample, statistics of the step. `not_drafting`
        seconds of the call were work any q would have paid (context writes held back
        by earlier steps without drafting) and are left out of D."""
        st = self._step
        if st is None:
            return
        if st.in_run:  # counted now; the samples wait for fold_runs()
            self.stats.record_step(st.plan.q, st.budgets, OPTIMAL)
            self._run_log[-1] += [now, not_drafting, int(st.budgets.sum()), st.expected_accepted]
            self._step = None
            return
        requests = len(st.req_ids)
        parts = (0.0, 0.0)
        if requests and st.plan.reason in (OPTIMAL, EXPLORE, PROBE, OFF_EPOCH):  # forced, warm-up: no forecast
            parts = self.controller.forecast_parts(requests, st.plan.q, int(st.budgets.sum()))
        self._close_cycle(st.t0, now, not_drafting, requests, st.plan.q, parts, st.expected_accepted)
        self.stats.record_step(st.plan.q, st.budgets[st.eligible] if st.budgets.size else
                               np.zeros(int(st.eligible.sum()), dtype=np.int64), st.plan.reason)
        self.controller.prior.forget(st.req_ids)
        self.offsets.forget(st.req_ids)
        self._remember_batch(st.req_ids)
        self._step = None

    def _remember_batch(self, req_ids: list[str]) -> None:
        """The step's requests, as the next step's `_prev_req_list` and `_prev_req_ids` (the set
        is rebuilt only when the batch changed)."""
        if req_ids != self._prev_req_list:
            self._prev_req_list, self._prev_req_ids = req_ids, set(req_ids)

    def _close_cycle(self, start: float, end: float, not_drafting: float, requests: int, q: int,
                     parts: tuple[float, float], expected_accepted: float) -> None:
        """A call from `start` to `end` (of which `not_drafting` seconds were not drafting)
        that drafted q positions for `requests` requests: its D(R, q + 1) sample, and the
        cycle (forecast `parts`, expected accepted drafts) the next step's sample closes."""
        drafting = max(end - start - not_drafting, 0.0)
        shape = (requests, q)
        if shape not in self._drafted_shapes and not self.measure_first_calls:
            # The first call of a block shape pays one-off costs (the draft's kernels for a new shape,
            # lazy set-up: at one request the first context write alone took 21.8 ms against 0.05 ms
            # after). As a sample it set the drafting factor at one request to 2.3x its forecast after
            # the bench's warm-up (which meets one request for a few steps only): drafting then looked
            # dearer than it was for hundreds of steps (20-38% of code steps drafting where static
            # k = 15 ran 1.3x; bfloat16, AVX-512 EPYC). It is no sample of the curves, the realised
            # factors or the arms.
            self._drafted_shapes.add(shape)
            parts = (0.0, 0.0)
        elif requests:
            self.controller.draft_cost.observe(requests, q + 1, drafting / self.speed.factor)
        self._drafted_before = None if self._prev_cycle is None else self._prev_cycle[0] > 0
        self._prev_cycle = (q, *parts, drafting / self.speed.factor, expected_accepted, requests, drafting,
                            max(end - start - drafting, 0.0))
        self._prev_end = end
