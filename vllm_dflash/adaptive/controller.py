"""How much to draft and verify this step: the decision, on synthetic or measured inputs.

The objective is output tokens per second of the whole step cycle. A cycle
is this step's drafting (D, already paid when budgets are chosen) plus the
next step outside drafting, E(R, R + B), which verifies B draft positions
for R requests and yields R bonus tokens plus the accepted drafts:

    value(B) = (R + sum of the B highest survival scores) / (E(R, R + B) + D)

Two decisions per step:

1. `plan` (before drafting): the query length q in 0..k from the expected
   survival of each request (`calibration.SurvivalPrior`) and the predicted
   draft time D(R, q + 1): q = argmax_q max_B value. q = 0 drafts nothing.
2. `budgets` (after drafting): from the posterior survival S [R, q] of the
   actual drafts, rank every (request, position) pair, take the best B, and
   give request i the b_i in [0, q] of its positions among them (S falls
   along a draft, so the chosen positions form a prefix of each draft).

The curves' seconds for drafting and for not drafting are each scaled by
how long cycles of that kind really took per token against their forecast,
per batch size (`realized`; a drafting cycle's tokens against those its
budgets expected): what the fits cannot see still reaches the decision.
Drafting's seconds are also scaled by what its busy periods lost at their
end, where requests it put out of step finish one by one (`drain`).
After steps without drafting, the first drafting step writes the context they
held back; drafting is planned only where it finishes the requests' remaining
tokens sooner with that cost paid (`switch_pays`).
Where the measured tokens per second of drafting and not drafting differ
beyond their noise (`realized.ArmRates`, drafting's rate scaled by its
drain; the burden of proof on drafting: one standard error behind stops it,
two ahead start it), that verdict decides between drafting and not; while the plan is to
draft, the curves see drafting ahead by less than `probe_margin` and the
measurements cannot yet tell, about a `probe_probability` share of decisions
does not draft (a probe), in runs of `probe_steps` steps: only a cycle of the
same kind as the one before it is measured, so a lone no-draft step among
drafting ones would measure nothing. At a batch size whose no-draft step was
never measured, the first plan to draft is preceded by a run of
`first_no_draft_steps` steps without drafts: its cost there is otherwise only
carried over from other sizes, and nothing would ever correct it. The other way
round, at a batch size where drafting was never measured (its curves extrapolated
from warm-up's few long blocks), the first plan not to draft, while the arms cannot
tell, is preceded by a run of `first_draft_steps` drafting steps at the curves' best
drafting q (`_drafting_unmeasured`), unless the curves put drafting far behind
(`UNMEASURED_MARGIN`): otherwise no drafting cost there is ever measured, and a size
that was meant to draft never does.

Above all of this, the policy itself is measured (`epochs`): epochs of steps
at one batch size run either as planned here or without drafting, and where
not drafting delivers more tokens per wall second, most epochs there plan
nothing (reason `off`) without consulting the curves. Before that verdict, while
OFF's epochs merely ran faster (`PolicyEpochs.off_leads`), a plan the arms do not
decide drafts only where the curves put drafting more than `probe_margin` ahead:
a smaller lead is within the curves' error, and the measured policy says the
other way. Traced at 8 requests (float32, Zen 4 EPYC, bundled pair): after each
pass's new requests reset the arms, the curves put drafting 1.06-1.23x ahead
again, and the ADAPTIVE epochs that drafted on it ran 965-1045 tok/s against
1148-1168 for OFF's, drafting steps 1104 tok/s against 1144-1302 without.

Estimates only stay right if their inputs cover the whole range: the first
`warmup_steps` decisions (then `knot_warmup_steps` at each further batch
size the cost model keeps a knot for, unless measured sizes on both sides
let the curves interpolate; the curves of the nearest measured sizes stand
in meanwhile) draft randomised q (full blocks half the time, none a fifth)
with randomised per-request budgets, and later a step
explores (a longer q, random extra positions or full blocks for some
requests; or, while drafting, no draft) with a probability capped so that it
costs at most `explore_time_share` of the predicted time: a longer block is
priced as full blocks verified for everyone, no draft as the output it
forgoes. Decisions are deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllm_dflash.adaptive.calibration import KIND_NAMES, OWN_ROW_MIN_WEIGHT, AcceptanceModel, SurvivalPrior
from vllm_dflash.adaptive.cost_model import StepCost, nearest_knot
from vllm_dflash.adaptive.drain import DrainLoss
from vllm_dflash.adaptive.epochs import OFF, PolicyEpochs
from vllm_dflash.adaptive.realized import ArmRates, RealizedRatio

OPTIMAL, WARMUP, EXPLORE, PROBE, FORCED = "optimal", "warmup", "explore", "probe", "forced"
OFF_EPOCH = "off"  # a step of an epoch run without drafting (`epochs.PolicyEpochs`)
CALM = "calm"  # a step a run's draw decided: no probe, no exploration (`run_cut_short`)
# A longer query block whose plan value is this close to the best one's is preferred (`longest_near_best`).
# A plan values each q on the mean prior survival; the budgets then follow each draft's own, and a
# confident draft verifies deep. The mean over drafts of each draft's best value exceeds the value of
# the mean draft, the more the longer the block: at one request on prose (float32, AVX-512 EPYC, 874
# drafts of the bundled pair) by 0.1% at q = 5, 1.2% at q = 10 and 2.6% at q = 15. At 0.5% the plans
# there settled on q = 7-11 and verified ~6 a step, where static k = 15 ran 1.25-1.3x faster.
LONGER_BLOCK_TOLERANCE = 0.03
# A plan at one request is valued on the kind's recent drafts once it has this many (`_sampled_rows`).
SAMPLED_PLAN_MIN_ROWS = 8
# A plan without drafts that the measured arms decide (their verdict: not drafting is ahead beyond
# the noise) is redone after up to this many `refresh_steps` while replanning keeps giving it (other
# plans after up to 4x): the curves cannot change it, and the checks that replan at once still run
# at every run of steps (`steady_run`: a moved realised/forecast factor, a changed verdict, a drawn
# exploration). The replans in between were ~0.45 ms each, ~30 us a step at 8 requests (float32,
# AVX-512 EPYC). Applied to every plan without drafts, one request whose plan was no draft kept it
# for a whole request: static k = 15 at one request went from 1.02x to 0.89x (same machine).
NO_DRAFT_REFRESH_FACTOR = 16
# A size where drafting was never measured is measured first (`_drafting_unmeasured`) only while the
# curves' best drafting plan is within this log-ratio of not drafting's value. The measured cycles
# moved drafting's forecast by factors of 0.87-1.41 and a plain step's by 0.48-1.0 (float32, Zen 4
# EPYC, 1-16 requests): a gap of e^0.5 = 1.65x is beyond what such errors close. Forced
# regardless, the run at 8 and 16 requests (curves: drafting at 0.29x and 0.43x) cost its 7
# drafting steps and the held context's write (19 ms at 16 requests) in the first cell there.
UNMEASURED_MARGIN = 0.5


class _CachedPlan(NamedTuple):
    """A batch size's plan and the curves it came from, reused until it is stale."""

    stamp: int  # the decision it was made at
    step: np.ndarray  # E over B = 0..R*k verified positions
    draft: np.ndarray  # D over q = 0..k
    q: int
    seconds: float  # the planned cycle's predicted seconds
    full_seconds: float  # the costliest cycle's (full blocks, all verified)
    explore_cost: float  # what an exploring step costs, in planned steps (`_exploration_cost`)
    factors: tuple[float, float]  # the realised/forecast seconds-per-token factors the plan used
    interval: int  # decisions until the next replan
    req_ids: list[str]  # the requests it was made for
    verdict: int  # the measured arms' verdict it followed (`ArmRates.verdict`)
    off_lead: bool  # the epochs had OFF ahead (`PolicyEpochs.off_leads`): drafting needed the curves clearly ahead
    other_q: int  # the q of the arm it did not pick (0, or the best drafting q)
    probe: bool  # the curves see the arms close and the measured arms cannot yet tell
    other_verifies: bool  # other_q's best budget verifies something
    draft_ratio: float  # the best drafting q's value over not drafting's (measured seconds)
    none_value: float  # not drafting's value: expected tokens per second of a step without drafts
    basis: tuple[int, ...] | None  # requests per kind, where that is all the plan rests on (`_plan_basis`)


@dataclass
class Plan:
    q: int
    reason: str


def best_budget(survival: np.ndarray, requests: int, step_seconds: np.ndarray) -> tuple[int, np.ndarray, float]:
    """(B*, order, value): the B maximising (requests + top-B survival) / step_seconds[B].

    `survival` [R, q] (any R, q); `step_seconds` [R * q + 1] is the predicted
    cycle time for every B. `order` ranks the flattened pairs, best first
    (position order within a request on ties).
    """
    flat = survival.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    gains = np.concatenate([[0.0], np.cumsum(flat[order])])
    value = (requests + gains) / step_seconds
    b = int(np.argmax(value))
    return b, order, float(value[b])


def budgets_from_order(order: np.ndarray, chosen: int, rows: int, width: int) -> np.ndarray:
    """Per-request budgets b_i of the first `chosen` pairs of `order`."""
    if width == 0 or chosen == 0:
        return np.zeros(rows, dtype=np.int64)
    return np.bincount(order[:chosen] // width, minlength=rows).astype(np.int64)


class BudgetController:
    """The per-step decisions of adaptive speculation; see the module docstring."""

    def __init__(self, max_k: int, max_requests: int, seed: int = 0, warmup_steps: int = 16, knot_warmup_steps: int = 4,
                 explore_time_share: float = 0.01, max_explore_probability: float = 0.05,
                 per_request_prior: bool = True, refresh_steps: int = 16, probe_margin: float = 0.2,
                 probe_probability: float = 0.125, probe_steps: int = 4, first_no_draft_steps: int = 7,
                 first_draft_steps: int = 7):
        if max_k < 1:
            raise ValueError(f"max_k={max_k} must be >= 1")
        self.max_k = max_k
        self.acceptance = AcceptanceModel(max_k)
        self.prior = SurvivalPrior(max_k)
        self.step_cost = StepCost(max_k + 1, max_requests)
        self.draft_cost = StepCost(max_k + 1, max_requests)
        self.rng = np.random.default_rng(seed)
        self.warmup_steps = warmup_steps
        self.knot_warmup_steps = knot_warmup_steps
        self.explore_time_share = explore_time_share
        self.max_explore_probability = max_explore_probability
        self.per_request_prior = per_request_prior
        self.refresh_steps = refresh_steps
        if probe_steps < 1:
            raise ValueError(f"probe_steps={probe_steps} must be >= 1")
        self.probe_margin, self.probe_probability = probe_margin, probe_probability
        self.probe_steps = probe_steps
        if first_no_draft_steps < 0:
            raise ValueError(f"first_no_draft_steps={first_no_draft_steps} must be >= 0")
        self.first_no_draft_steps = first_no_draft_steps
        if first_draft_steps < 0:
            raise ValueError(f"first_draft_steps={first_draft_steps} must be >= 0")
        self.first_draft_steps = first_draft_steps
        self._no_draft_seen: set[int] = set()  # batch-size knots whose no-draft step was measured or is being
        self._draft_seen: set[int] = set()  # batch-size knots whose drafting was measured or is being
        # knot -> the plan (its stamp) at which measuring drafting there was last declined for the held context
        self._switch_declined: dict[int, int] = {}
        # The open run of the other kind (`_start_other_run`): further steps, its q and reason.
        self._other_left, self._other_q, self._other_reason = 0, 0, PROBE
        self._warmup_done: dict[int, int] = {}
        self._warmup_total = 0
        self._knots = self.step_cost.r_knots.tolist()
        self.realized = RealizedRatio(self._knots)
        self.arms = ArmRates(self._knots)
        self.drain = DrainLoss(self._knots, no_draft_share=max_explore_probability)
        self.epochs = PolicyEpochs(self.rng, size_key=self._size_knot)
        self.epochs.cycle_advantage = self._cycle_advantage
        self._decisions = 0
        # EXPLORE / PROBE drawn by steady_run(), or CALM (`run_cut_short`): plan() carries it out
        self._explore_next: str | None = None
        # request ids -> [R] logit shifts of their acceptance (AdaptiveSpeculation's RequestOffsets)
        self.request_shifts: Callable[[list[str]], np.ndarray] | None = None
        # request ids -> (seconds the first drafting step would spend writing context held back while
        # nothing was drafted, output tokens the requests have left (None: unbounded)): the proposer's
        self.switch_cost: Callable[[list[str]], tuple[float, int | None]] | None = None
        self._cache: dict[int, _CachedPlan] = {}  # per batch size
        # Where plan() reports each replan and each step of another reason than OPTIMAL, as a dict
        # (`PlanTrace`, VLLM_DFLASH_ADAPTIVE_TRACE); None: nothing is kept.
        self.trace: Callable[[dict], None] | None = None
        self._replan: dict | None = None  # what the last replan saw, for the trace

    # ------------------------------------------------------------- planning --

    def _size_knot(self, requests: int) -> int:
        """The cost model's batch-size knot nearest to `requests` (its value): what the policy
        epochs are kept under, so a batch that dips by one request keeps its verdict."""
        return int(self._knots[nearest_knot(self._knots, requests)])

    def _cycle_advantage(self, requests: int) -> float:
        """The measured arms' drafting tokens per second over not drafting's at this batch size
        (1 until both have `ArmRates.min_cycles` cycles)."""
        if min(self.arms.cycles(requests, False), self.arms.cycles(requests, True)) < self.arms.min_cycles:
            return 1.0
        no_draft, drafting = self.arms.rates(requests)
        return drafting / no_draft if no_draft > 0 else 1.0

    def _warmup_key(self, requests: int) -> int:
        """Warm-up is counted per batch-size knot of the cost model (the nearest one)."""
        return nearest_knot(self._knots, requests)

    def in_warmup(self, requests: int) -> bool:
        if not (self.step_cost.ready and self.draft_cost.ready):
            return True
        done = self._warmup_done.get(self._warmup_key(requests), 0)
        first = self._warmup_total - done < self.warmup_steps  # no other size warmed up yet
        if first:
            return done < self.warmup_steps
        # A further batch size warms up only where the cost curves would be
        # extrapolated (no measured size at or above it): between measured sizes
        # they interpolate, and exploration refines them. Warm-up steps verify
        # full blocks for many requests, so each one costs several plain steps.
        return done < self.knot_warmup_steps and not self._bracketed(requests)

    def _bracketed(self, requests: int) -> bool:
        """Both cost surfaces hold measured batch-size knots below and above the
        knot of `requests` (its own knot, the one being warmed up, aside)."""
        key = self._warmup_key(requests)
        for cost in (self.step_cost, self.draft_cost):
            cost.fold_queued()
            measured = np.flatnonzero(cost.weight.sum(axis=1) >= cost.min_weight)
            if not ((measured < key).any() and (measured > key).any()):
                return False
        return True

    def plan(self, req_ids: list[str], kinds: np.ndarray) -> Plan:
        """Query length q for the R = len(req_ids) requests of this step."""
        if self.trace is None:
            return self._plan(req_ids, kinds)
        self._replan = None
        plan = self._plan(req_ids, kinds)
        if self._replan is not None or plan.reason != OPTIMAL:
            self.trace({"decision": self._decisions, "requests": len(req_ids), "q": plan.q, "reason": plan.reason,
                        **(self._replan or {})})
        return plan

    def _plan(self, req_ids: list[str], kinds: np.ndarray) -> Plan:
        requests = len(req_ids)
        if requests == 0:
            return Plan(0, OPTIMAL)
        if self.in_warmup(requests):
            self.epochs.abort()  # warm-up's random plans are neither policy
            key = self._warmup_key(requests)
            self._warmup_done[key] = self._warmup_done.get(key, 0) + 1
            self._warmup_total += 1
            # Full blocks half the time (deep positions get calibrated), no draft a fifth (the
            # no-draft step is the one every decision compares against), any q otherwise.
            u = self.rng.random()
            q = self.max_k if u < 0.5 else 0 if u < 0.7 else int(self.rng.integers(0, self.max_k + 1))
            return Plan(q, WARMUP)
        if self.epochs.policy(requests) == OFF:
            self._other_left, self._explore_next = 0, None  # a probe or exploration run ends here
            return Plan(0, OFF_EPOCH)
        entry = self._planned(req_ids, kinds)
        q = entry.q
        plan = Plan(q, OPTIMAL)
        explore_now, self._explore_next = self._explore_next, None
        if self._other_left > 0:  # a run of the other kind goes on while the plan is still of its kind
            self._other_left -= 1
            if (q > 0) != (self._other_q > 0):
                if self._other_left > 0:
                    self._explore_next = self._other_reason  # no cached-plan run meanwhile (steady_run)
                return Plan(self._other_q, self._other_reason)
            self._other_left = 0
            explore_now = None
        if q > 0 and self._no_draft_unmeasured(requests):
            self._start_other_run(0, PROBE, self.first_no_draft_steps)
            return Plan(0, PROBE)
        if q == 0 and explore_now is None and self._drafting_unmeasured(requests, entry, req_ids):
            self._start_other_run(entry.other_q, PROBE, self.first_draft_steps)
            return Plan(entry.other_q, PROBE)
        # Where the policy epochs have drafting ahead, their OFF epochs measure the steps without
        # drafts, and a probe or exploration without drafts only costs (`_no_draft_measured_off`).
        measured_off = q > 0 and self._no_draft_measured_off(requests)
        if explore_now == PROBE or (explore_now is None and entry.probe and not measured_off
                                    and self.rng.random() < self.probe_probability / self.probe_steps):
            if measured_off:  # (a plan drawn as a probe before the epochs confirmed drafting)
                return plan
            if entry.other_q == 0:
                self._start_other_run(0, PROBE)
            return Plan(entry.other_q, PROBE)
        if explore_now == EXPLORE or (explore_now is None and self.rng.random() < self._explore_start(entry)):
            # Both ways: longer blocks than planned, or (half the time, while drafting) none, so
            # a cost model that overrates the no-draft step is corrected too.
            if measured_off:
                if q < self.max_k:
                    plan = Plan(int(self.rng.integers(q + 1, self.max_k + 1)), EXPLORE)
            elif q > 0 and (q == self.max_k or self.rng.random() < 0.5):
                self._start_other_run(0, EXPLORE)
                plan = Plan(0, EXPLORE)
            elif q < self.max_k:
                plan = Plan(int(self.rng.integers(q + 1, self.max_k + 1)), EXPLORE)
                if q == 0:
                    self._start_other_run(plan.q, EXPLORE)
        return plan

    def _no_draft_measured_off(self, requests: int) -> bool:
        """The policy epochs have drafting ahead at this batch size (`PolicyEpochs.confirmed`): the
        steps without drafts there are measured by the OFF epochs they still run, so a drafting plan
        neither probes nor explores without drafts. At one request in bfloat16 (Xeon with AMX,
        bundled pair) explorations and probes without drafts took 5-8% of the steps, each at ~0.6x
        of a drafting step's tokens per second, on top of the OFF epochs."""
        return self.epochs.confirmed(requests)

    def _no_draft_unmeasured(self, requests: int) -> bool:
        """True once per batch-size knot, at the first plan to draft there, if fewer cycles
        without drafts were measured there than the arms' verdict needs (`ArmRates.min_cycles`).
        The no-draft step of a size seen only in drafting (and warm-up, whose scattered no-draft
        steps are no samples) is priced from other sizes: in a bench that meets 4 requests after
        1 and 2, E(4, 1) came out 3.1 ms against ~1.9 ms measured without speculation, drafting
        looked 1.6x ahead, and the arms could never say otherwise: 0.77-0.91x of no speculation
        (bfloat16, AVX-512 EPYC)."""
        if self.first_no_draft_steps == 0:
            return False
        return self._first_at_knot(self._no_draft_seen, requests, drafted=False)

    def _drafting_unmeasured(self, requests: int, entry: _CachedPlan, req_ids: list[str]) -> bool:
        """True once per batch-size knot, at the first plan not to draft there that the arms
        do not decide, if fewer drafting cycles were measured there than the arms' verdict
        needs and the curves' best drafting q verifies something. A size's drafting curves
        come from warm-up's few steps (mostly full blocks: at 4 requests, a handful of samples
        at t = 8-16, shorter blocks extrapolated), so a plan may never draft there, and then
        nothing it would draft is ever measured: in bench order, 4 requests after 1 and 2 drafted
        in 0-7% of steps in some runs and 63-95% in others, as early explorations happened to
        fall (float32, AVX-512 EPYC), where static k = 15 ran 1.06-1.19x of no speculation on
        prose. The run's cycles after the first reach the arms, whose verdict then decides.
        (A plan without drafts always has a drafting q to compare, `other_q` >= 1.) Nor where the
        curves put drafting further behind than errors of their size close (`UNMEASURED_MARGIN`).
        Nor, for now, where the run's first step would write more held context than drafting
        that far ahead of the curves would pay back before the requests finish (`switch_pays`):
        at 64 requests in flight the run started where the curves had drafting at 0.66x, and
        writes of held context there took up to 48 ms (8,192 rows; float32, Zen 4 EPYC). The
        size is asked again at its next plan, when less may be held (once per plan: pricing the
        held rows walks the queue)."""
        if (self.first_draft_steps == 0 or not entry.other_verifies or entry.verdict != 0
                or not entry.draft_ratio > math.exp(-UNMEASURED_MARGIN)):
            return False
        knot = nearest_knot(self._knots, requests)
        if knot in self._draft_seen or self._switch_declined.get(knot) == entry.stamp:
            return False
        if self.switch_cost is not None:
            best_case = entry.none_value * entry.draft_ratio * math.exp(UNMEASURED_MARGIN)
            if not self.switch_pays(entry.none_value, best_case, *self.switch_cost(req_ids)):
                self._switch_declined[knot] = entry.stamp
                return False
        return self._first_at_knot(self._draft_seen, requests, drafted=True)

    def _first_at_knot(self, seen: set[int], requests: int, drafted: bool) -> bool:
        """True the first time a batch-size knot is asked (`seen` holds the knots asked) if that
        arm has fewer cycles there than the arms' verdict needs (`ArmRates.min_cycles`). Fewer
        cycles count as unmeasured: one warm-up cycle at 2 requests (2.87 ms, bfloat16) had
        skipped the first no-draft run, and drafting ran at 0.94x there."""
        knot = nearest_knot(self._knots, requests)
        if knot in seen:
            return False
        seen.add(knot)
        return self.arms.cycles(requests, drafted) < self.arms.min_cycles

    def _start_other_run(self, q: int, reason: str, steps: int | None = None) -> None:
        """A step of the other kind than the plan's (not drafting while the plan drafts: a probe
        or an exploring step; drafting while it does not: an exploring step) is the first of
        `probe_steps` such steps, at the same q. Only cycles of the same kind as the one before
        them are measured (`AdaptiveSpeculation._switched_kind`): the first step after a switch
        carries the tail of the step before (traced at 4 requests in bfloat16: a plain step
        right after drafting took 2.35 ms, against ~1.95 ms in a row of them), so a lone step
        of the other kind would measure nothing."""
        self._other_left, self._other_q, self._other_reason = (steps or self.probe_steps) - 1, q, reason
        if self._other_left > 0:
            self._explore_next = reason

    def _explore_probability(self, entry: _CachedPlan) -> float:
        """The share of steps that explore."""
        return min(self.max_explore_probability, self.explore_time_share / max(entry.explore_cost, 1e-12))

    def _explore_start(self, entry: _CachedPlan) -> float:
        """The chance that a step starts exploring: the share of exploring steps over the mean
        length of an exploration (a step of the other kind than the plan's starts a run of
        `probe_steps`, `_start_other_run`; half of a partial-block plan's explorations do)."""
        runs = 1.0 if entry.q == 0 or entry.q == self.max_k else 0.5
        return self._explore_probability(entry) / (1.0 + runs * (self.probe_steps - 1))

    def _exploration_cost(self, q: int, seconds: float, full_seconds: float, values: np.ndarray) -> float:
        """What an exploring step costs, in planned steps (`seconds`: the plan's cycle, `full_seconds`:
        the costliest, both as measured cycles ran against the curves): a longer block, at most full
        blocks verified for everyone, costs their extra seconds; no draft (while drafting)
        costs the output it forgoes, 1 - its tokens per second / the plan's. Priced as
        full blocks, a plan already at full blocks looked free to explore, and explored at
        the cap: at one request, 5% of steps went without drafting, each at ~0.45x the
        plan's tokens per second (float32, bundled pair)."""
        longer = (full_seconds - seconds) / seconds
        if q == 0:
            return longer
        none = max(1.0 - float(values[0] / values[q]), 0.0)
        return none if q == self.max_k else 0.5 * (none + longer)  # plan(): half of the steps each way

    def steady_run(self, req_ids: list[str], most: int, drafting: bool = False,
                   kinds: np.ndarray | None = None) -> tuple[int, int]:
        """(steps, q): how many steps, from this one, the requests `req_ids` may keep their
        batch size's cached plan q without planning (its time factors have not moved, and
        none of those steps is due for a replan or draws exploration), at most `most`;
        only a plan that drafts (`drafting`) or only one that does not. With the requests'
        `kinds`, a plan made for other requests with the same basis is theirs too, as
        `_planned` would take it (`_plan_basis`); without, it holds for a quarter of
        `refresh_steps` (`_stale`). The caller skips
        planning for those steps and reports them with `coasted`; a run without drafting
        also skips everything a plan would need (request kinds, eligibility, priors): on a
        busy CPU a step without drafting must cost what a step without speculation costs,
        and a drafting step must cost what static speculation costs.
        (0, 0): call plan() now (which then explores if that is what this step drew).

        The per-step draws of a probe or exploration are made once per run: with the
        same plan every step, the steps until the first one are geometric, and a run
        that ends before it draws afresh (memoryless), so the chance per step is what
        drawing every step would give. A run that ends early drops its draw (`run_cut_short`)."""
        requests = len(req_ids)
        # A run stays within its epoch, of one policy. Its first step counts the cycle planned before
        # it, so the cycle of its last plan is counted a step after the run: a run as long as the epoch
        # had left carried that cycle into the next epoch (traced: OFF epochs at one request holding
        # one drafting cycle and its accepted tokens, 509 tok/s against ~250 for the others).
        epoch_left = self.epochs.steps_left(requests) - 1
        if self.epochs.off_now and not self.in_warmup(requests):  # (warm-up is planned step by step)
            return (0, 0) if drafting or epoch_left <= 0 else (min(most, epoch_left), 0)
        # Drawn by the last run: carried out by plan(). A calm step (the run before was cut short here,
        # `run_cut_short`) may open a run: the draw below is for the steps after it.
        calm_now = self._explore_next == CALM
        if self._explore_next is not None and not calm_now:
            return 0, 0
        most = min(most, epoch_left)
        entry = self._cache.get(requests)
        if (entry is None or (entry.q > 0) != drafting or self._inputs_moved(
                entry, self.time_factors(requests), self.verdict(requests), self.epochs.off_leads(requests))):
            return 0, 0
        entry = self._carried_over(requests, entry, req_ids, kinds)
        limit = entry.interval if req_ids == entry.req_ids else max(1, self.refresh_steps // 4)
        run = min(most, limit - (self._decisions - entry.stamp) - 1)  # _stale(entry, req_ids, ahead=1..run)
        if run <= 0:
            return 0, 0
        measured_off = entry.q > 0 and self._no_draft_measured_off(requests)  # as plan() draws
        probe = self.probe_probability / self.probe_steps if entry.probe and not measured_off else 0.0
        explore = 0.0 if measured_off and entry.q == self.max_k else self._explore_start(entry)
        chance = 1.0 - (1.0 - probe) * (1.0 - explore)
        if chance > 0.0:
            calm = int(self.rng.geometric(chance)) - 1 + calm_now  # steps before the first probe or exploration
            if calm < run:
                self._explore_next = PROBE if self.rng.random() * chance < probe else EXPLORE
                run = calm
            elif calm_now:
                self._explore_next = None
        elif calm_now:
            self._explore_next = None
        return (run, entry.q) if run > 0 else (0, 0)

    def run_cut_short(self) -> None:
        """A run from steady_run() ends at this step, one of its own (a changed batch, a
        prompt chunk), which plans instead or opens a run of its own (`steady_run`, for the
        steps after it). The run's draw already said this step is calm
        (no probe, no exploration), so it draws nothing; a probe or exploration the run
        drew for a later step is dropped, and the steps after this one draw afresh
        (memoryless). Drawing again at this step, or keeping the later draw, explores
        more than planned (measured: runs cut after one step explored at 7-33% a step
        where 5% was planned)."""
        self._explore_next = CALM

    def coasted(self, steps: int) -> None:
        """`steps` steps of a run from steady_run() went by (decisions, for staleness)."""
        self._decisions += steps

    def _planned(self, req_ids: list[str], kinds: np.ndarray) -> _CachedPlan:
        """The batch size's plan (its cost curves and q), recomputed every
        `refresh_steps` decisions, or up to 4x that while replanning keeps giving the
        same q (costs and acceptance drift slowly; replanning every step would cost
        more than it changes), 16x for a plan without drafts that the measured arms decide
        (`NO_DRAFT_REFRESH_FACTOR`), and at once when a realised/forecast factor moves.
        The predicted seconds of drafting and of not drafting are scaled by how long
        cycles of each kind took against their forecast (`realized`)."""
        requests = len(req_ids)
        self._decisions += 1
        entry = self._cache.get(requests)
        factors = self.time_factors(requests)
        verdict = self.verdict(requests)
        off_lead = self.epochs.off_leads(requests)
        moved = entry is not None and self._inputs_moved(entry, factors, verdict, off_lead)
        if entry is not None and not moved:
            entry = self._carried_over(requests, entry, req_ids, kinds)
        if entry is None or self._stale(entry, req_ids) or moved:
            k = self.max_k
            step = self.step_cost.predict(requests, 1.0 + np.arange(requests * k + 1) / requests)
            draft = self.draft_cost.predict(requests, 1.0 + np.arange(k + 1))
            shifts = None if self.request_shifts is None else self.request_shifts(req_ids)
            sample = self._sampled_rows(kinds) if requests == 1 else None
            if sample is not None:
                values, seconds, full, verifies = self.plan_values_sampled(sample, step, draft)
            else:
                prior = self.prior.rows(req_ids, kinds, self.per_request_prior, shifts)
                values, seconds, full, verifies = self.plan_values(prior, requests, step, draft)
            no_draft, drafting = factors
            scaled = values / np.where(np.arange(len(values)) == 0, no_draft, drafting)
            best_draft = self.longest_near_best(scaled[1:]) + 1
            # The measured arms overrule the curves where they differ beyond their noise.
            q = best_draft if verdict > 0 else 0 if verdict < 0 else (
                best_draft if scaled[best_draft] > scaled[0] else int(np.argmax(scaled)))
            if verdict == 0 and off_lead and q > 0 and not scaled[q] > scaled[0] * math.exp(self.probe_margin):
                q = 0  # the curves' lead is within their error, and the epochs measured not drafting ahead
            switch = self.switch_cost(req_ids) if self.switch_cost is not None else (0.0, None)
            basis = self._plan_basis(req_ids, kinds, sample is not None, shifts)
            if q > 0 and not self.switch_pays(float(scaled[0]), float(scaled[q]), *switch):
                q, basis = 0, None  # (the requests' own tokens left and held context decided)
            other_q = 0 if q > 0 else best_draft
            # Only a plan to draft is probed (against not drafting): not drafting is the safe arm, and
            # at many requests a drafting step costs later steps too (requests fall out of step, so new
            # prompts land in more steps), which no cycle of its own shows.
            # (A ratio that is not a positive number, from a degenerate curve, is no case for a probe:
            # math.log of it had raised in a serving step under load.)
            ratio = float(scaled[best_draft] / scaled[0]) if scaled[0] > 0 else math.inf
            probe = (verdict == 0 and q > 0 and bool(verifies[best_draft])
                     and 0.0 < ratio < math.exp(self.probe_margin))
            # A plan that comes out the same again is trusted for twice as long (up to 4x
            # `refresh_steps`, NO_DRAFT_REFRESH_FACTOR x for the arms' no draft): in a steady regime
            # replanning is most of what a step without drafting costs the controller.
            same = entry is not None and not moved and q == entry.q and req_ids == entry.req_ids
            factor = NO_DRAFT_REFRESH_FACTOR if q == 0 and verdict < 0 else 4
            interval = min(2 * entry.interval, factor * self.refresh_steps) if same else self.refresh_steps
            if q == 0 and self.prior.fading(req_ids):
                # Not drafting because of requests' own last drafts: those rows fade into their kind's
                # mean within a few steps (`SurvivalPrior.fade_steps`), so the plan is redone then. At
                # one request, one poor draft had kept drafting off for up to 4x `refresh_steps` (traced
                # on code: 20-35 of ~120 steps coasting at half the tokens per second of drafting).
                # A row weighs 1/R in a plan: R x fade_steps bounds the replanning per step. Without
                # such rows nothing fades: at 4 requests coasting in bfloat16, replanning every 16 steps
                # was 0.05 ms of a 1.6 ms step (AVX-512 EPYC).
                interval = min(interval, max(1, int(self.prior.fade_steps * requests)))
            # Priced in measured seconds, as the plan's values are: the curves alone had a drafting
            # step's seconds 1.34-1.41x short and a plain step's up to 2x long at 8-16 requests
            # (float32, Zen 4 EPYC): priced on the curves, an exploration there cost up to ~3x its share.
            planned_seconds = float(seconds[q]) * (no_draft if q == 0 else drafting)
            explore_cost = self._exploration_cost(q, planned_seconds, full * drafting, scaled)
            if q == 0:  # an exploring step drafts, and first writes the held context
                explore_cost += switch[0] / planned_seconds
            if self.trace is not None:
                self._replan = {"values": [round(float(v), 3) for v in scaled], "best_draft": best_draft,
                                "planned_q": q, "verdict": verdict, "off_lead": off_lead,
                                "factors": [round(f, 4) for f in factors],
                                "arms": [round(r, 1) for r in self.arms.rates(requests)],
                                "arm_cycles": [round(self.arms.cycles(requests, d), 1) for d in (False, True)],
                                "switch_seconds": round(switch[0], 6), "tokens_left": switch[1], "probe": probe}
            entry = _CachedPlan(self._decisions, step, draft, q, float(seconds[q]), full, explore_cost, factors,
                                interval, req_ids, verdict, off_lead, other_q, probe, bool(verifies[other_q]), ratio,
                                float(scaled[0]), basis)
            self._cache[requests] = entry
        return entry

    def _carried_over(self, requests: int, entry: _CachedPlan, req_ids: list[str],
                      kinds: np.ndarray | None) -> _CachedPlan:
        """`entry`, made theirs where it was made for other requests with the same basis
        (`_plan_basis`: then the plan is the same for them); as it was otherwise, or without
        the requests' `kinds`."""
        if (req_ids != entry.req_ids and kinds is not None and entry.basis is not None
                and entry.basis == self._plan_basis(req_ids, kinds)):
            entry = self._cache[requests] = entry._replace(req_ids=req_ids)
        return entry

    def _plan_basis(self, req_ids: list[str], kinds: np.ndarray, sampled: bool | None = None,
                    shifts: np.ndarray | None = None) -> tuple[int, ...] | None:
        """Requests per kind, when nothing else of `req_ids` goes into their plan: no request has
        a survival row of its own that `SurvivalPrior.rows` still weighs, nor a shift that lifts
        its kind's mean (or one request is planned on its kind's recent rows, `_sampled_rows`,
        `sampled`; None: look). Then the plan is the same for any requests with the same basis,
        and a cached plan carries over to them, replanned on its own interval. `shifts`: the
        requests' shifts where the caller already has them (None: asked here).

        Without it a new request restarted replanning from `refresh_steps` / 4: with requests
        coming and going every few dozen steps and never drafting, plans were redone every
        16-32 steps at ~1.2 ms each, a third of what a step without drafting cost the proposer
        (bfloat16, 16 requests, Zen 4 EPYC)."""
        kinds = np.asarray(kinds, dtype=np.int64)
        basis = tuple(np.bincount(kinds, minlength=len(KIND_NAMES)).tolist())
        if not self.per_request_prior:
            return basis
        if sampled is None:
            sampled = len(req_ids) == 1 and self._sampled_rows(kinds) is not None
        if sampled:
            return basis
        if self.prior.fading(req_ids, weight=OWN_ROW_MIN_WEIGHT):
            return None
        if shifts is None and self.request_shifts is not None:
            shifts = self.request_shifts(req_ids)
        if shifts is not None and bool((np.asarray(shifts) > 0.0).any()):
            return None
        return basis

    @staticmethod
    def longest_near_best(values: np.ndarray, tolerance: float = LONGER_BLOCK_TOLERANCE) -> int:
        """The index of the longest block whose value is within `tolerance` of the best. A plan's
        value is what the prior survival expects on average; the budgets after drafting follow each
        draft's own confidence, and a longer block lets a confident draft verify deeper. Where
        drafting costs about the same for any q (one query-block forward), blocks past the
        expected budget tie, and the first of them (the shortest) had capped every budget there:
        at one request, blocks of 7 instead of 15 (0.91x of static k = 15, float32, AVX-512 EPYC)."""
        top = float(values.max())
        return int(np.flatnonzero(values >= top * (1.0 - tolerance))[-1])

    @staticmethod
    def switch_pays(none_rate: float, draft_rate: float, switch_seconds: float, tokens_left: int | None) -> bool:
        """Whether drafting at `draft_rate` tokens per second, after `switch_seconds` writing the
        context held back while nothing was drafted, finishes the requests' `tokens_left` sooner
        than not drafting at `none_rate`. Held rows of a request that finishes undrafted are never
        written (`serving.context_queue`), so the first drafting step after a run without drafting
        pays for every earlier step. Measured in the engine at 16 requests (float32, bundled pair,
        AVX2): such a write took 18 ms, about one step without drafting; at the end of a busy
        period (a few requests left, where drafting pays per step) it bought a handful of drafting
        steps. None: the requests never stop, any one-off cost pays."""
        if switch_seconds <= 0.0 or tokens_left is None:
            return True
        if draft_rate <= 0.0 or none_rate <= 0.0:
            return draft_rate > none_rate
        return tokens_left / draft_rate + switch_seconds < tokens_left / none_rate

    def time_factors(self, requests: int) -> tuple[float, float]:
        """(no-draft, drafting) factors on forecast seconds at this batch size: how cycles of
        each kind ran against their forecast (`realized`), drafting's also by the drain it
        leaves at the end of a busy period (`drain`)."""
        no_draft, drafting = self.realized.factors(requests)
        return no_draft, drafting / self.drain.factor(requests)

    def verdict(self, requests: int) -> int:
        """The measured arms' verdict (`ArmRates.verdict`), drafting's rate scaled by its drain."""
        return self.arms.verdict(requests, drafting_scale=self.drain.factor(requests))

    def _stale(self, entry: _CachedPlan, req_ids: list[str], ahead: int = 0) -> bool:
        """The plan `entry` is due for a redo at this decision (`ahead`: counted from the
        next one). A plan made for other requests is redone after a quarter of
        `refresh_steps`: it rests on their survival priors (at one request, on the
        previous request's), and a new request has its own after a few drafts."""
        age = self._decisions + ahead - entry.stamp
        if req_ids == entry.req_ids:
            return age >= entry.interval
        return age >= max(1, self.refresh_steps // 4)

    def _inputs_moved(self, entry: _CachedPlan, factors: tuple[float, float], verdict: int, off_lead: bool) -> bool:
        """What the plan `entry` rested on changed (its time factors by over 10%, the arms' verdict, the
        epochs' lead): it is redone now, and no run coasts on it (`_planned`, `steady_run`)."""
        return self._factors_moved(entry.factors, factors) or verdict != entry.verdict or off_lead != entry.off_lead

    @staticmethod
    def _factors_moved(then: tuple[float, float], now: tuple[float, float], tolerance: float = 0.1) -> bool:
        """A realised/forecast time factor moved by more than `tolerance` since the plan:
        the curves were wrong by that much where this plan runs (a new batch size, most
        often), so the plan is redone now rather than after `refresh_steps` more steps
        at the wrong q."""
        return any(abs(b / a - 1.0) > tolerance for a, b in zip(then, now))

    def plan_values(self, prior: np.ndarray, requests: int, step: np.ndarray | None = None,
                    draft: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        """From prior survival [R, k]: expected tokens per second of drafting
        q = 0..k (at each q's best B), the predicted cycle seconds there, the
        seconds of the costliest cycle (full blocks, all verified), which
        bounds what an exploring step can cost, and whether each q's best B
        verifies anything.

        One sort serves every q: survival falls along a draft, so the best B
        pairs among positions < q are the sorted pairs with position < q."""
        k = self.max_k
        if step is None:
            step = self.step_cost.predict(requests, 1.0 + np.arange(requests * k + 1) / requests)
        if draft is None:
            draft = self.draft_cost.predict(requests, 1.0 + np.arange(k + 1))
        flat = prior[:, :k].reshape(-1)
        order = np.argsort(-flat, kind="stable")
        position = (order % k)[None, :]
        inside = position < np.arange(k + 1)[:, None]  # [q, pair]
        gains = np.cumsum(np.where(inside, flat[order][None, :], 0.0), axis=1)
        count = np.cumsum(inside, axis=1)
        value = (requests + gains) / (step[count] + draft[:, None])
        value0 = requests / (step[0] + draft)  # B = 0
        best = np.argmax(value, axis=1)
        rows = np.arange(k + 1)
        best_value = value[rows, best]
        use0 = value0 >= best_value
        values = np.where(use0, value0, best_value)
        seconds = np.where(use0, step[0], step[count[rows, best]]) + draft
        return values, seconds, float(step[-1] + draft[-1]), ~use0

    def _sampled_rows(self, kinds: np.ndarray) -> np.ndarray | None:
        """The recent drafted rows of one request's kind (`SurvivalPrior.recent`) when there
        are at least SAMPLED_PLAN_MIN_ROWS of them: the sample a plan at one request is
        valued on (`plan_values_sampled`). None: plan on the mean row."""
        if not self.per_request_prior:
            return None
        rows = self.prior.recent(int(kinds[0]))
        return rows if rows.shape[0] >= SAMPLED_PLAN_MIN_ROWS else None

    def plan_values_sampled(self, rows: np.ndarray, step: np.ndarray, draft: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        """`plan_values` at one request, valued over a sample of survival rows [n, k] instead of
        on their mean: each row verifies what its own best budget would (as `budgets` chooses
        for a drafted block), and q's value is the tokens over the seconds of them all.

        The value of a block length is not the value of the mean row: a confident draft
        verifies deep and a doubtful one stops early, and a long block pays for the first
        (on the mean row the deep positions look poor, so the plan cut every draft short:
        at one request on prose, plans settled on q = 7-11 where static k = 15 ran 1.25-1.3x
        faster, float32, AVX-512 EPYC; `LONGER_BLOCK_TOLERANCE` only softened that).
        `step` [k + 1]: E(1, 1 + B) for B = 0..k; `draft` [k + 1]: D(1, q + 1)."""
        k = self.max_k
        gains = np.concatenate([np.zeros((rows.shape[0], 1)), np.cumsum(rows[:, :k], axis=1)], axis=1)  # [n, B]
        tokens = 1.0 + gains
        budget = np.arange(k + 1)
        # [q, n, B]: each row's value of verifying B of a q-block; B > q cannot be verified.
        seconds = step[None, None, : k + 1] + draft[:, None, None]
        value = np.where(budget[None, None, :] <= budget[:, None, None], tokens[None, :, :] / seconds, -np.inf)
        best = np.argmax(value, axis=2)  # [q, n]
        got = tokens[np.arange(rows.shape[0])[None, :], best]  # [q, n]: each row's tokens at its best budget
        took = step[best] + draft[:, None]
        values = got.sum(axis=1) / took.sum(axis=1)
        return values, took.mean(axis=1), float(step[k] + draft[k]), (best > 0).any(axis=1)

    def forecast_seconds(self, requests: int, q: int, total_budget: int) -> float:
        """The cycle time the curves predict for drafting q and verifying `total_budget`
        positions at this batch size, from the plan's cached curves (0: none cached)."""
        return sum(self.forecast_parts(requests, q, total_budget))

    def forecast_parts(self, requests: int, q: int, total_budget: int) -> tuple[float, float]:
        """(drafting, step outside drafting) seconds of `forecast_seconds` ((0, 0): none cached)."""
        entry = self._cache.get(requests)
        if entry is None:
            return 0.0, 0.0
        step, draft = entry.step, entry.draft
        return float(draft[min(q, len(draft) - 1)]), float(step[min(total_budget, len(step) - 1)])

    def step_seconds(self, requests: int, tokens: int, cached_only: bool = False) -> float:
        """E(requests, tokens / requests): the predicted step outside drafting for `tokens`
        scheduled tokens, prompt chunks counted like verified drafts (both are query rows
        of the target forward); from the cached plan's curve where it reaches, else the
        cost surface (0: nothing measured yet, or not cached with `cached_only`)."""
        entry = self._cache.get(requests)
        extra = tokens - requests
        if entry is not None and 0 <= extra < len(entry.step):
            return float(entry.step[extra])
        if cached_only or not self.step_cost.ready or requests < 1:
            return 0.0
        return float(self.step_cost.predict(requests, [tokens / requests])[0])

    # -------------------------------------------------------------- budgets --

    def step_curve(self, requests: int, width: int) -> np.ndarray:
        """E over B = 0..requests * width verified positions: the plan's cached curve while
        the plan is current, else predicted afresh."""
        entry = self._cache.get(requests)
        if entry is not None and self._decisions - entry.stamp < entry.interval:
            return entry.step[: requests * width + 1]
        return self.step_cost.predict(requests, 1.0 + np.arange(requests * width + 1) / requests)

    def budgets(self, plan: Plan, survival: np.ndarray, draft_seconds: float,
                eligible: np.ndarray | None = None) -> np.ndarray:
        """[R] verify lengths in [0, q] from posterior survival [R, q]; rows not
        `eligible` (partial prefills: their drafts are discarded) get 0."""
        rows, width = survival.shape
        if width == 0 or rows == 0:
            return np.zeros(rows, dtype=np.int64)
        if eligible is None:
            eligible = np.ones(rows, dtype=bool)
        if plan.reason == WARMUP:
            full = self.rng.random(rows) < 0.5
            out = np.where(full, width, self.rng.integers(0, width + 1, size=rows))
            return np.where(eligible, out, 0).astype(np.int64)
        live = int(eligible.sum())
        if live == 0:
            return np.zeros(rows, dtype=np.int64)
        step = self.step_curve(live, width)
        rows_live = survival if live == rows else survival[eligible]
        chosen, order, _ = best_budget(rows_live, live, step + draft_seconds)
        out = np.zeros(rows, dtype=np.int64)
        out[eligible] = budgets_from_order(order, chosen, live, width)
        if plan.reason == EXPLORE:
            # Random extra positions (full blocks for some) keep E(R, t) and the
            # deep positions' calibration measured.
            pick = eligible & (self.rng.random(rows) < 0.5)
            if not pick.any():
                pick[np.flatnonzero(eligible)[self.rng.integers(0, live)]] = True
            extra = np.where(self.rng.random(rows) < 0.5, width, self.rng.integers(0, width + 1, size=rows))
            out = np.where(pick, np.maximum(out, extra), out)
        return out


class ForcedSchedule:
    """Test hook (VLLM_DFLASH_ADAPTIVE_SCHEDULE): budgets decided by a seeded
    random schedule instead of by cost. `kind`:

    * "jump": each step q is 0 (no draft forward) or k, and the requests of a
      step get different budgets among 0, k and values in between;
    * "pause:A:B": full blocks, except no drafting in steps A..B-1.
    """

    def __init__(self, spec: str, max_k: int, seed: int = 0):
        parts = spec.split(":")
        self.kind = parts[0]
        if self.kind == "jump" and len(parts) == 1:
            self.pause = None
        elif self.kind == "pause" and len(parts) == 3 and all(p.isdigit() for p in parts[1:]):
            self.pause = (int(parts[1]), int(parts[2]))
        else:
            raise ValueError(f"adaptive schedule {spec!r}: use 'jump' or 'pause:FIRST:END' (step numbers)")
        self.max_k = max_k
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def plan(self, req_ids: list[str], kinds: np.ndarray) -> Plan:
        self.step += 1
        if self.pause is not None:
            first, end = self.pause
            return Plan(0 if first <= self.step - 1 < end else self.max_k, FORCED)
        return Plan(self.max_k if self.step % 3 else 0, FORCED)

    def steady_run(self, req_ids: list[str], most: int, drafting: bool = False,
                   kinds: np.ndarray | None = None) -> tuple[int, int]:
        """(steps, 0): the steps of a pause from the next one on, at most `most` (none outside a
        pause, or for `drafting`): they coast as the controller's runs without drafting do
        (`AdaptiveSpeculation.coast`), so tests that force a pause take that path too."""
        if drafting or self.pause is None:
            return 0, 0
        first, end = self.pause
        inside = first <= self.step < end  # plan() numbers the step it plans self.step (from 0)
        return (min(most, end - self.step), 0) if inside else (0, 0)

    def coasted(self, steps: int) -> None:
        """`steps` steps of a run from steady_run() went by."""
        self.step += steps

    def budgets(self, plan: Plan, survival: np.ndarray, draft_seconds: float,
                eligible: np.ndarray | None = None) -> np.ndarray:
        rows, width = survival.shape
        if self.pause is not None or width == 0:
            return np.full(rows, width, dtype=np.int64)
        choice = self.rng.integers(0, 3, size=rows)
        out = np.where(choice == 0, 0, np.where(choice == 1, width, self.rng.integers(1, width + 1, size=rows)))
        return out.astype(np.int64)
