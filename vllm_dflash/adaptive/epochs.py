"""Whole stretches of steps with speculation off, against the controller's, end to end.

Every other estimate in adaptive speculation prices one cycle: the curves
forecast it, `realized.RealizedRatio` corrects the forecast per kind of
cycle, `realized.ArmRates` measures each kind's tokens per second, and
`drain.DrainLoss` adds what a busy period loses at its end. What none of them
sees is what drafting costs between its own cycles: the first drafting step
writing the context held back before it, the probes and explorations that
keep the arms measured, cycles that count for neither kind. Traced at 8
requests in the 3-round bench of 1039079 (Zen 4 EPYC, bundled pair): the arms
measured drafting cycles ahead of no-draft cycles (1880 against 1650 tok/s,
2000 against 1780), the curves put drafting 1.1-1.3x ahead, and the engine
drafted in 35% of steps while running 0.86-0.91x of one without speculation.

So the policy itself is measured, not its cycles: epochs of `epoch_steps`
consecutive steps at one batch size run either as the controller decides
(ADAPTIVE) or with no drafting at all (OFF), and each epoch's tokens per
second of wall time between step starts (everything the engine did in them)
is one sample of its policy at that batch size. An epoch ends early, unused,
where the batch size changes by more than a quarter (a dip of one request as
one finishes is part of the epoch, `_continues`), the engine idles or warm-up
runs. The policies are compared epoch against neighbouring epoch (`_pair`):
each one's rate follows the text, and a mean over all epochs compares
stretches of different text. While the two cannot be told apart, a
`trial_share` of epochs run OFF; once OFF is ahead by `stop_z` standard errors
(the burden of proof on drafting, as in `ArmRates`), epochs run OFF and a
`retest_share` of them run ADAPTIVE, so a change of text or load is seen (fewer
where ADAPTIVE's epochs lose more: a retest costs that loss,
`retest_share_at`); once ADAPTIVE is ahead by `z` errors, only a
`confirmed_share` run OFF. An ADAPTIVE epoch that drafted in no step is the
OFF policy already: no sample of either.

A trial costs what drafting gains where drafting pays. At one request the
epochs' rates follow the text (ADAPTIVE epochs at 190-720 tok/s in one
bfloat16 run against OFF ones at 150-430), so the verdict came and went, and
with a quarter of epochs off while undecided one bfloat16 round ran 35% of
its one-request steps off: 1.29x of no speculation where the round before this
module ran 1.67x. So an undecided batch size is tried off at `trial_share`
while either rate is unmeasured, at `off_lead_share` while OFF's measured rate
is ahead, at half of `trial_share` while ADAPTIVE's is ahead, and at the
`confirmed_share` once ADAPTIVE's
epochs (`min_epochs` of them, against a single OFF epoch: OFF's rate does
not follow the text, see `_open`) or the cycles' own arms
(`cycle_advantage`, the controller's
`ArmRates`) put it more than `clear_advantage` ahead: the bias traced above
had drafting cycles 1.12-1.14x ahead where the policy lost 9-14%.
Where drafting about breaks even (4 requests in the 3-round bench of
cc87fb2: 13-20 epochs of 32 steps per engine, the verdict reached in 2 of 6,
drafting in 27-52% of steps at 0.87-0.96x of no speculation), the trials are
what decides: so epochs are 16 steps (twice the samples, `memory` doubled to
keep the same stretch of steps), trials run at half the epochs while OFF
leads, and a step that prefilled a prompt chunk counts in its epoch's length
but not in its rate: a prompt costs the same under either policy per token it
leads to, and its step, several decode steps long, is noise the verdict would
have to average out.
Draws come from the controller's generator: decisions stay deterministic for
a seed. Nothing here is a per-machine constant: the rates are measured on the
running engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

ADAPTIVE, OFF = 0, 1
POLICY_NAMES = ("adaptive", "off")


def _forget_add(moments: list[float] | tuple[float, float, float], x: float, keep: float) -> list[float]:
    """Forgetting [weight, sum, sum of squares] with `x` added and older values kept at `keep`."""
    n, s, s2 = moments
    return [n * keep + 1.0, s * keep + x, s2 * keep + x * x]


class PolicyEpochs:
    """See the module docstring. Per batch size (the exact number of requests in a step):
    forgetting sums of each policy's per-epoch log rate. `step` takes every step in order;
    `policy` says which policy the epoch holding the coming step runs."""

    def __init__(self, rng: np.random.Generator, epoch_steps: int = 16, memory: float = 32.0, min_epochs: int = 3,
                 z: float = 2.0, stop_z: float = 1.0, noise_floor: float = 0.03, trial_share: float = 0.25,
                 off_lead_share: float = 0.5, retest_share: float = 0.125, confirmed_share: float = 1.0 / 32,
                 clear_advantage: float = 1.3, retest_cost: float = 0.01, size_tolerance: float = 0.75,
                 pair_overlap: float = 2.0, size_key: Callable[[int], int] | None = None):
        if (epoch_steps < 2 or memory < 1 or min_epochs < 2 or z <= 0 or not 0 < stop_z <= z or noise_floor <= 0
                or not all(0 < s < 1 for s in (trial_share, off_lead_share, retest_share, confirmed_share))
                or clear_advantage < 1 or retest_cost <= 0 or not 0 < size_tolerance <= 1 or pair_overlap < 1):
            raise ValueError("PolicyEpochs needs epoch_steps >= 2, memory >= 1, min_epochs >= 2, z > 0, "
                             "0 < stop_z <= z, noise_floor > 0, shares in (0, 1), clear_advantage >= 1, "
                             "retest_cost > 0, size_tolerance in (0, 1] and pair_overlap >= 1")
        self.rng = rng
        self.epoch_steps, self.memory, self.min_epochs = epoch_steps, float(memory), min_epochs
        self._keep = 1.0 - 1.0 / self.memory
        self.z, self.stop_z, self.noise_floor = z, stop_z, noise_floor
        self.trial_share, self.retest_share, self.confirmed_share = trial_share, retest_share, confirmed_share
        self.off_lead_share = off_lead_share
        self.clear_advantage = clear_advantage
        self.retest_cost, self.size_tolerance, self.pair_overlap = retest_cost, size_tolerance, pair_overlap
        # batch size -> the size its epochs are kept under (the cost model's nearest knot: 7 and 8 alike)
        self.size_key: Callable[[int], int] = size_key or (lambda requests: requests)
        # requests -> drafting cycles' tokens per second over no-draft cycles' (1: unmeasured)
        self.cycle_advantage: Callable[[int], float] = lambda requests: 1.0
        # requests -> per policy [epochs measured (forgetting), sum of log rates, sum of their squares]
        self._sums: dict[int, list[list[float]]] = {}
        # requests -> forgetting [weight, sum, sum of squares] of paired differences, log ADAPTIVE's
        # rate - log OFF's, of consecutive epochs of the two policies there (`_pair`)
        self._pairs: dict[int, list[float]] = {}
        # requests -> (policy, log rate, step count) of the last epoch closed there
        self._last: dict[int, tuple[int, float, int]] = {}
        self._clock = 0  # steps taken, every batch size
        # The open epoch: its batch size at opening, policy, steps counted, seconds, tokens and drafting steps.
        self._requests, self._policy = 0, ADAPTIVE
        self._steps, self._seconds, self._tokens, self._drafted = 0, 0.0, 0.0, 0
        self.off_now = False  # the open epoch runs OFF (read on every coasting step: an attribute)
        self.epochs_closed = [0, 0]
        # Where each closed epoch is reported (the controller's plan trace); None: nowhere.
        self.trace: Callable[[dict], None] | None = None

    # -------------------------------------------------------------- epochs --

    def policy(self, requests: int) -> int:
        """The policy of the epoch the next step of `requests` requests falls in (an epoch of
        another batch size, or a full one, gives way to a new one, its policy drawn now)."""
        if not self._continues(requests) or self._steps >= self.epoch_steps:
            self._open(requests)
        return self._policy

    def _continues(self, requests: int) -> bool:
        """A step of `requests` requests belongs to the open epoch: its size, or one within
        `size_tolerance` of it (both at least 3). With requests in flight the batch dips by one
        for a step whenever a request finishes before the next one is scheduled: at 8 requests
        (64-token requests) every few steps, and an epoch that ended at each dip closed about one
        time in eight (float32, Xeon with AMX, bundled pair: 6 epochs in ~800 steps of one cell),
        so the verdict waited while trials ran. Both policies meet the dips alike; a request
        that finishes sooner under drafting is part of what drafting delivers."""
        opened = self._requests
        if requests == opened:
            return True
        small, large = min(requests, opened), max(requests, opened)
        return small >= 3 and small >= self.size_tolerance * large

    def steps_left(self, requests: int) -> int:
        """Steps the epoch that the next step of `requests` requests falls in has left, that one included."""
        self.policy(requests)
        return self.epoch_steps - self._steps

    def step(self, requests: int, drafted: bool, seconds: float, tokens: float, plain: bool = True) -> None:
        """A step of `requests` requests that yielded `tokens` in `seconds` (from its start to the
        next step's); `drafted`: the cycle verified drafts; `plain`: no prompt chunk in the step
        (a step that prefilled is one of the epoch's steps, but not in its rate)."""
        if requests <= 0 or seconds <= 0:
            return
        self._clock += 1
        if not self._continues(requests):  # a batch-size change: this cycle was planned for the epoch it ends
            self._open(requests)
            return
        self.policy(requests)
        self._steps += 1
        if plain:
            self._seconds += seconds
            self._tokens += tokens
            self._drafted += int(drafted)
        if self._steps >= self.epoch_steps:
            self._close()

    def abort(self) -> None:
        """The open epoch ends unused (the engine idled, or warm-up plans the next steps)."""
        self._requests = 0
        self._steps = self.epoch_steps  # the next policy() opens a new epoch

    def _open(self, requests: int) -> None:
        self._requests, self._steps, self._seconds, self._tokens, self._drafted = requests, 0, 0.0, 0.0, 0
        verdict, share = self.verdict(requests), self.trial_share
        if verdict == 0:
            advantage = self.advantage(requests)
            if self._clear_lead(requests):
                verdict = 1
            elif advantage >= 1.0:
                share = self.trial_share / 2
            elif advantage > 0.0:
                share = self.off_lead_share
        if verdict:
            share = self.confirmed_share if verdict > 0 else 1.0 - self.retest_share_at(requests)
        self._policy = OFF if self.rng.random() < share else ADAPTIVE
        self.off_now = self._policy == OFF

    def confirmed(self, requests: int) -> bool:
        """ADAPTIVE is ahead at this batch size: by its verdict, or by a clear lead (`_clear_lead`).
        OFF's epochs (`confirmed_share` of them) then measure the steps without drafts there."""
        return self.verdict(requests) > 0 or self._clear_lead(requests)

    def _clear_lead(self, requests: int) -> bool:
        """The cycles' own arms, or ADAPTIVE's epochs (`min_epochs` of them) against OFF's (one is
        enough), put ADAPTIVE more than `clear_advantage` ahead. A clear lead needs one OFF epoch
        only: OFF yields one token per request a step whatever the text, so its epochs differ only
        as the machine's speed does, while ADAPTIVE's follow the text. At one request in bfloat16
        (Xeon with AMX, bundled pair) OFF epochs ran 276-315 tok/s, ADAPTIVE's 200-1390, so the
        verdict waited on ADAPTIVE's spread: one round's one-request cell ran 7 OFF epochs (13% of
        its steps) while ADAPTIVE's ran 1.5-1.8x faster."""
        sums = self._sums.get(self.size_key(requests))
        measured = sums is not None and sums[ADAPTIVE][0] >= self.min_epochs - 1e-9 and sums[OFF][0] >= 1.0 - 1e-9
        clear_a, clear_off = self.rates(requests) if measured else (0.0, 0.0)
        return (self.cycle_advantage(requests) > self.clear_advantage
                or clear_a > self.clear_advantage * clear_off > 0)

    def retest_share_at(self, requests: int) -> float:
        """The share of ADAPTIVE epochs once OFF is ahead: `retest_share`, or less where the
        measured loss of an ADAPTIVE epoch would make the retests cost over `retest_cost` of
        the output (share x loss), never under `confirmed_share`. At 8 requests in float32
        (Xeon with AMX, bundled pair) ADAPTIVE epochs ran 0.75-0.85x of OFF's: one in eight
        of them cost 2-3% of the cell."""
        advantage = self.advantage(requests)
        loss = 1.0 - advantage if advantage > 0.0 else 0.0
        if loss <= 0.0:
            return self.retest_share
        return min(self.retest_share, max(self.confirmed_share, self.retest_cost / loss))

    def _close(self) -> None:
        policy, requests = self._policy, self.size_key(self._requests)
        self.abort()
        if self._tokens <= 0 or self._seconds <= 0 or (policy == ADAPTIVE and self._drafted == 0):
            return
        x = math.log(self._tokens / self._seconds)
        sums = self._sums.setdefault(requests, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        sums[policy] = _forget_add(sums[policy], x, self._keep)
        self._pair(requests, policy, x)
        self.epochs_closed[policy] += 1
        if self.trace is not None:
            self.trace({"epoch": POLICY_NAMES[policy], "requests": requests,
                        "tok_s": round(self._tokens / self._seconds, 1),
                        "drafting_steps": self._drafted, "verdict": self.verdict(requests),
                        "rates": [round(r, 1) for r in self.rates(requests)],
                        "advantage": round(self.advantage(requests), 3),
                        "pairs": round(self._pairs.get(requests, [0.0])[0], 2)})

    def _pair(self, requests: int, policy: int, x: float) -> None:
        """One paired difference where this epoch (log rate `x`) follows one of the other policy
        at this batch size with at most an epoch's steps between them. Each policy's mean rate
        follows the text and the context length, and one policy's epochs can all fall in a
        stretch of one kind: in the 3-round bench of d46306f (Xeon with AMX, bundled pair), OFF's
        epochs at 4 requests ran 500-1100 tok/s as the cells went from code to prose, and the
        means of all epochs had ADAPTIVE at 0.70x of OFF where its epochs against their
        neighbours ran 1.01x (0.83x against 0.96x at 8 requests; 0.94x against 1.07x in another
        round). Neighbours see the same stretch."""
        last = self._last.get(requests)
        self._last[requests] = (policy, x, self._clock)
        if last is None or last[0] == policy or self._clock - last[2] > 2 * self.epoch_steps:
            return
        d = x - last[1] if policy == ADAPTIVE else last[1] - x
        self._pairs[requests] = _forget_add(self._pairs.get(requests, (0.0, 0.0, 0.0)), d, self._keep)

    # ------------------------------------------------------------ verdicts --

    def rates(self, requests: int) -> tuple[float, float]:
        """(ADAPTIVE, OFF) geometric-mean tokens per second of the epochs measured; 0 where none."""
        sums = self._sums.get(self.size_key(requests))
        if sums is None:
            return 0.0, 0.0
        return tuple(math.exp(s / n) if n > 0 else 0.0 for n, s, _ in sums)

    def advantage(self, requests: int) -> float:
        """ADAPTIVE's tokens per second over OFF's at this batch size, from the paired differences
        (`_pair`, at least `min_epochs` of them); 0 while fewer."""
        paired = self._paired(requests)
        return math.exp(paired[0]) if paired is not None else 0.0

    def _paired(self, requests: int) -> tuple[float, float] | None:
        """(mean paired difference, its squared standard error) at this batch size, or None with
        fewer than `min_epochs` pairs. Consecutive pairs share an epoch (A O A: two pairs, one OFF
        epoch), so the error is widened by `pair_overlap`; each difference's variance is at least
        that of two epochs at `noise_floor`."""
        n, s, s2 = self._pairs.get(self.size_key(requests), (0.0, 0.0, 0.0))
        if n < self.min_epochs - 1e-9:
            return None
        mean = s / n
        return mean, self.pair_overlap * max(s2 / n - mean * mean, 2.0 * self.noise_floor ** 2) / n

    def off_leads(self, requests: int) -> bool:
        """OFF's epochs ran faster than ADAPTIVE's neighbours at this batch size, by any margin
        (`advantage` under 1): the controller then wants the curves clearly ahead before it
        drafts (`BudgetController._planned`)."""
        return 0.0 < self.advantage(requests) < 1.0

    def verdict(self, requests: int) -> int:
        """+1: ADAPTIVE delivers more than OFF at this batch size by over `z` standard errors of
        the paired differences; -1: less, by over `stop_z`; 0: fewer than `min_epochs` pairs, or within."""
        paired = self._paired(requests)
        if paired is None:
            return 0
        difference, spread = paired
        if difference > self.z * math.sqrt(spread):
            return 1
        if difference < -self.stop_z * math.sqrt(spread):
            return -1
        return 0
