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
where the batch size changes, the engine idles or warm-up runs. While the two
policies' mean log rates cannot be told apart, a `trial_share` of epochs run
OFF; once OFF is ahead by `stop_z` standard errors (the burden of proof on
drafting, as in `ArmRates`), epochs run OFF and a `retest_share` of them run
ADAPTIVE, so a change of text or load is seen; once ADAPTIVE is ahead by `z`
errors, only a `confirmed_share` run OFF. An ADAPTIVE epoch that drafted in no
step is the OFF policy already: no sample of either.

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

from vllm_dflash.adaptive.realized import difference_variance

ADAPTIVE, OFF = 0, 1
POLICY_NAMES = ("adaptive", "off")


class PolicyEpochs:
    """See the module docstring. Per batch size (the exact number of requests in a step):
    forgetting sums of each policy's per-epoch log rate. `step` takes every step in order;
    `policy` says which policy the epoch holding the coming step runs."""

    def __init__(self, rng: np.random.Generator, epoch_steps: int = 16, memory: float = 32.0, min_epochs: int = 3,
                 z: float = 2.0, stop_z: float = 1.0, noise_floor: float = 0.03, trial_share: float = 0.25,
                 off_lead_share: float = 0.5, retest_share: float = 0.125, confirmed_share: float = 1.0 / 32,
                 clear_advantage: float = 1.3):
        if (epoch_steps < 2 or memory < 1 or min_epochs < 2 or z <= 0 or not 0 < stop_z <= z or noise_floor <= 0
                or not all(0 < s < 1 for s in (trial_share, off_lead_share, retest_share, confirmed_share))
                or clear_advantage < 1):
            raise ValueError("PolicyEpochs needs epoch_steps >= 2, memory >= 1, min_epochs >= 2, z > 0, "
                             "0 < stop_z <= z, noise_floor > 0, shares in (0, 1) and clear_advantage >= 1")
        self.rng = rng
        self.epoch_steps, self.memory, self.min_epochs = epoch_steps, float(memory), min_epochs
        self.z, self.stop_z, self.noise_floor = z, stop_z, noise_floor
        self.trial_share, self.retest_share, self.confirmed_share = trial_share, retest_share, confirmed_share
        self.off_lead_share = off_lead_share
        self.clear_advantage = clear_advantage
        # requests -> drafting cycles' tokens per second over no-draft cycles' (1: unmeasured)
        self.cycle_advantage: Callable[[int], float] = lambda requests: 1.0
        # requests -> per policy [epochs measured (forgetting), sum of log rates, sum of their squares]
        self._sums: dict[int, list[list[float]]] = {}
        # The open epoch: its batch size, policy, steps counted, seconds, tokens and drafting steps.
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
        if requests != self._requests or self._steps >= self.epoch_steps:
            self._open(requests)
        return self._policy

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
        if requests != self._requests:  # a batch-size change: this cycle was planned for the epoch it ends
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
            # A clear lead needs one OFF epoch only: OFF yields one token per request a step whatever
            # the text, so its epochs differ only as the machine's speed does, while ADAPTIVE's follow
            # the text. At one request in bfloat16 (Xeon with AMX, bundled pair) OFF epochs ran 276-315
            # tok/s, ADAPTIVE's 200-1390, so the verdict waited on ADAPTIVE's spread: one round's
            # one-request cell ran 7 OFF epochs (13% of its steps) while ADAPTIVE's ran 1.5-1.8x faster.
            clear_a, clear_off = self._measured_rates(requests, off_epochs=1)
            a, off = self._measured_rates(requests)
            if (self.cycle_advantage(requests) > self.clear_advantage
                    or clear_a > self.clear_advantage * clear_off > 0):
                verdict = 1
            elif a >= off > 0:
                share = self.trial_share / 2
            elif off > a > 0:
                share = self.off_lead_share
        if verdict:
            share = self.confirmed_share if verdict > 0 else 1.0 - self.retest_share
        self._policy = OFF if self.rng.random() < share else ADAPTIVE
        self.off_now = self._policy == OFF

    def _close(self) -> None:
        policy, requests = self._policy, self._requests
        self.abort()
        if self._tokens <= 0 or self._seconds <= 0 or (policy == ADAPTIVE and self._drafted == 0):
            return
        x = math.log(self._tokens / self._seconds)
        sums = self._sums.setdefault(requests, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        keep = 1.0 - 1.0 / self.memory
        n, s, s2 = sums[policy]
        sums[policy] = [n * keep + 1.0, s * keep + x, s2 * keep + x * x]
        self.epochs_closed[policy] += 1
        if self.trace is not None:
            self.trace({"epoch": POLICY_NAMES[policy], "requests": requests,
                        "tok_s": round(self._tokens / self._seconds, 1),
                        "drafting_steps": self._drafted, "verdict": self.verdict(requests),
                        "rates": [round(r, 1) for r in self.rates(requests)]})

    # ------------------------------------------------------------ verdicts --

    def rates(self, requests: int) -> tuple[float, float]:
        """(ADAPTIVE, OFF) geometric-mean tokens per second of the epochs measured; 0 where none."""
        sums = self._sums.get(requests)
        if sums is None:
            return 0.0, 0.0
        return tuple(math.exp(s / n) if n > 0 else 0.0 for n, s, _ in sums)

    def off_leads(self, requests: int) -> bool:
        """OFF's epochs ran faster than ADAPTIVE's at this batch size, by any margin, both measured
        (`min_epochs`): the controller then wants the curves clearly ahead before it drafts
        (`BudgetController._planned`)."""
        a, off = self._measured_rates(requests)
        return off > a

    def _measured_rates(self, requests: int, off_epochs: int | None = None) -> tuple[float, float]:
        """`rates` where both policies are measured at this batch size (`_both_measured`), else (0, 0)."""
        return self.rates(requests) if self._both_measured(requests, off_epochs) else (0.0, 0.0)

    def _both_measured(self, requests: int, off_epochs: int | None = None) -> bool:
        """ADAPTIVE has `min_epochs` epochs at this batch size and OFF `off_epochs` (None: `min_epochs`)."""
        sums = self._sums.get(requests)
        least = (self.min_epochs, self.min_epochs if off_epochs is None else off_epochs)
        return sums is not None and all(sums[p][0] >= least[p] - 1e-9 for p in (ADAPTIVE, OFF))

    def verdict(self, requests: int) -> int:
        """+1: ADAPTIVE delivers more than OFF at this batch size by over `z` standard errors;
        -1: less, by over `stop_z`; 0: fewer than `min_epochs` epochs of either, or within."""
        if not self._both_measured(requests):
            return 0
        sums = self._sums[requests]
        spread = difference_variance(sums, self.noise_floor)
        (na, sa, _), (no, so, _) = sums
        difference = sa / na - so / no
        if difference > self.z * math.sqrt(spread):
            return 1
        if difference < -self.stop_z * math.sqrt(spread):
            return -1
        return 0
