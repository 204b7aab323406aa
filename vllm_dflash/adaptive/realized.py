"""How long each step cycle took against what the cost curves forecast for it.

A plan's value (tokens per second of the cycle: this step's drafting plus
the next step's verification) divides expected tokens by the seconds the
fitted curves predict, D(R, q + 1) + E(R, R + B). The curves can be off in
ways their fits never see: a cost spread over the wrong regime, a batch size
measured in a few noisy steps, work that only runs when drafts exist. So
every steady cycle reports realised / forecast seconds (the forecast for the
q and B it actually ran), kept per batch-size knot, apart for cycles that
drafted (q > 0) and cycles that did not; each kind's predicted seconds are
scaled by its geometric-mean ratio once it has `min_cycles` cycles' worth of
evidence. A drafting cycle also counts how many tokens it yielded against the
expected count its budgets were chosen on (`expected_tokens` / `tokens`): a
factor on seconds per token, so a plan whose drafts yield less than promised
(acceptance calibrated on average, but off for this text or batch size) is
corrected by what actually came out, whichever estimate was wrong. A cycle
without drafts yields one token per request, exactly as expected. The ratios forget (`memory` cycles),
and exploration keeps both kinds measured. Four cycles suffice to act on: the
errors that matter are factors of 1.5-2 (measured at a batch size the curves
had only interpolated), and the controller replans as soon as a factor moves
by more than 10% (`BudgetController._factors_moved`).
"""

from __future__ import annotations

import math

import numpy as np

from vllm_dflash.adaptive.cost_model import nearest_knot


class RealizedRatio:
    """Per (batch-size knot, drafted or not): forgetting mean of log(realised / forecast seconds)."""

    def __init__(self, knots, memory: float = 32.0, min_cycles: float = 4.0, clip: float = 4.0,
                 stale_factor: float = 4.0):
        if memory < 1 or min_cycles <= 0 or clip <= 1 or stale_factor < 1:
            raise ValueError("RealizedRatio needs memory >= 1, min_cycles > 0, clip > 1, stale_factor >= 1")
        self.knots = [float(k) for k in knots]
        self.memory, self.min_cycles, self.log_clip = float(memory), float(min_cycles), math.log(clip)
        self.stale_factor = float(stale_factor)
        self._keep, self._fade = 1.0 - 1.0 / self.memory, 1.0 - 1.0 / (self.memory * self.stale_factor)
        # Per knot and kind: [log sum, weight]. Python floats: updated every step (numpy scalar
        # indexing made this a fifth of a coasting step's bookkeeping).
        self._sums = [[[0.0, 0.0], [0.0, 0.0]] for _ in self.knots]

    @property
    def log_sum(self) -> np.ndarray:
        """[knots, kind] forgetting sums of log(realised / forecast)."""
        return np.array([[kind[0] for kind in knot] for knot in self._sums])

    @property
    def weight(self) -> np.ndarray:
        """[knots, kind] forgetting cycle counts."""
        return np.array([[kind[1] for kind in knot] for knot in self._sums])

    def key(self, requests: int) -> int:
        """The nearest knot."""
        return nearest_knot(self.knots, requests)

    def observe(self, requests: int, drafted: bool, forecast: float, seconds: float,
                expected_tokens: float = 0.0, tokens: float = 0.0) -> None:
        """One cycle took `seconds` where the curves forecast `forecast` (<= 0: none), and
        yielded `tokens` where `expected_tokens` were expected (either <= 0: time only)."""
        if not (forecast > 0 and seconds > 0 and requests > 0):
            return
        x = math.log(seconds / forecast)
        if expected_tokens > 0 and tokens > 0:
            x += math.log(expected_tokens / tokens)
        x = min(max(x, -self.log_clip), self.log_clip)
        knot, keep, fade = self._sums[self.key(requests)], self._keep, self._fade
        mine, other = knot[int(drafted)], knot[1 - int(drafted)]
        mine[0], mine[1] = mine[0] * keep + x, mine[1] * keep + 1.0
        # The other kind's evidence goes stale while this kind runs: a factor that once
        # made drafting look bad would otherwise hold speculation off for good (a plan of
        # no draft measures only no-draft cycles; exploration adds a drafting cycle once
        # in a few hundred steps). It fades `stale_factor` times slower than it learns.
        other[0], other[1] = other[0] * fade, other[1] * fade

    def factors(self, requests: int) -> tuple[float, float]:
        """(no-draft, drafting) factors on forecast seconds at this batch size; 1 where unmeasured."""
        knot, least = self._sums[self.key(requests)], self.min_cycles - 1e-6
        no_draft, drafting = (math.exp(log_sum / w) if w >= least else 1.0 for log_sum, w in knot)
        return no_draft, drafting


class SpeedIndex:
    """How fast the machine runs now against the cost curves, as one factor on seconds.

    A shared CPU changes speed by tens of percent over tens of steps (measured here:
    identical 32-request decode steps took 7.3 ms, then 10.9 ms for fifteen steps, then
    8 ms again). The curves are fitted from samples taken at different times: a
    no-draft step measured in a slow stretch against drafting measured in a fast one
    made drafting look 25% cheaper than it was, and the controller drafted at a loss.
    A uniform change of speed does not change which plan is best (every value in a
    decision scales alike), so samples are folded in divided by the current index and
    the curves compare like with like. The index is a forgetting mean of
    log(seconds / predicted) over steps the curves can predict (`memory` steps), each
    ratio clipped to a factor `clip`, starting from `prior` steps' worth of 1.

    The scale of the curves is then arbitrary (a curve measured high pulls the index
    down, and every later sample up to its scale): harmless, since decisions compare
    seconds only with seconds. What the index removes is samples of different cells
    taken at different speeds; what remains per kind of cycle, `RealizedRatio` sees.
    """

    def __init__(self, memory: float = 32.0, clip: float = 3.0, prior: float = 4.0):
        if memory < 1 or clip <= 1 or prior < 0:
            raise ValueError("SpeedIndex needs memory >= 1, clip > 1 and prior >= 0")
        self.memory, self.log_clip = float(memory), math.log(clip)
        self.log_sum = 0.0
        self.weight = float(prior)
        self.factor = 1.0

    def observe(self, seconds: float, predicted: float) -> None:
        """A step took `seconds` where the curves (in index units) predicted `predicted`."""
        if not (seconds > 0 and predicted > 0):
            return
        x = min(max(math.log(seconds / predicted), -self.log_clip), self.log_clip)
        keep = 1.0 - 1.0 / self.memory
        self.log_sum = self.log_sum * keep + x
        self.weight = self.weight * keep + 1.0
        self.factor = math.exp(self.log_sum / self.weight) if self.weight > 0 else 1.0


class ArmRates:
    """Per batch-size knot: the output tokens per second that cycles which drafted, and
    cycles which did not, actually delivered; the last word where the curves cannot tell.

    `RealizedRatio` corrects each kind's forecast by how its cycles ran, but the decision
    still compares two corrected forecasts, and a correction only moves where its kind
    runs: traced at 8 requests in float32, the curves put drafting within a few percent
    of not drafting while it delivered ~20% fewer tokens per second (7.99 ms for 17.3
    tokens against 2.92 ms for 8), and which kind ran flipped from run to run. Here the
    two arms are measured as they are, ratio of forgetting sums (tokens / measured seconds:
    not in the speed index's units, which follow the curves' predictions and so would carry
    their error into the arm they mispredict), and compared with a two-sided test on the per-cycle log rates:
    `verdict` is +1 (drafting delivers more), -1 (not drafting does) or 0 (either arm has
    fewer than `min_cycles` cycles of evidence, or the difference is within `z` standard
    errors). An arm that stops running fades `stale_factor` times slower than it learns,
    as in `RealizedRatio`, so a verdict is re-examined, not kept for good.
    """

    def __init__(self, knots, memory: float = 32.0, min_cycles: float = 6.0, stale_factor: float = 4.0,
                 z: float = 2.0, noise_floor: float = 0.05):
        if memory < 1 or min_cycles <= 1 or stale_factor < 1 or z <= 0 or noise_floor <= 0:
            raise ValueError("ArmRates needs memory >= 1, min_cycles > 1, stale_factor >= 1, z > 0, noise_floor > 0")
        self.knots = [float(k) for k in knots]
        self.memory, self.min_cycles, self.stale_factor = float(memory), float(min_cycles), float(stale_factor)
        self.z, self.noise_floor = float(z), float(noise_floor)
        self._keep, self._fade = 1.0 - 1.0 / self.memory, 1.0 - 1.0 / (self.memory * self.stale_factor)
        # Per knot and arm (no draft, draft): forgetting sums of tokens, seconds, cycles, and the
        # per-cycle log rate and its square (the noise). Python floats: read on every step.
        self._sums = [[[0.0] * 5 for _ in range(2)] for _ in self.knots]

    def observe(self, requests: int, drafted: bool, seconds: float, tokens: float) -> None:
        """A cycle at `requests` that drafted or not yielded `tokens` in `seconds`."""
        if not (seconds > 0 and tokens > 0 and requests > 0):
            return
        arms = self._sums[nearest_knot(self.knots, requests)]
        keep, fade, x = self._keep, self._fade, math.log(tokens / seconds)
        t, s, n, lx, lx2 = arms[int(drafted)]
        arms[int(drafted)] = [t * keep + tokens, s * keep + seconds, n * keep + 1.0, lx * keep + x, lx2 * keep + x * x]
        arms[1 - int(drafted)] = [v * fade for v in arms[1 - int(drafted)]]

    def cycles(self, requests: int, drafted: bool) -> float:
        """The (forgetting) count of cycles behind an arm's rate."""
        return self._sums[nearest_knot(self.knots, requests)][int(drafted)][2]

    def rates(self, requests: int) -> tuple[float, float]:
        """(no-draft, drafting) tokens per second; 0 where nothing was measured."""
        arms = self._sums[nearest_knot(self.knots, requests)]
        return tuple(float(a[0] / a[1]) if a[1] > 0 else 0.0 for a in arms)

    def verdict(self, requests: int, drafting_scale: float = 1.0) -> int:
        """`drafting_scale`: a factor on the drafting arm's rate that no cycle measures (the
        drain it leaves at the end of a busy period, `drain.DrainLoss.factor`)."""
        arms = self._sums[nearest_knot(self.knots, requests)]
        if min(a[2] for a in arms) < self.min_cycles - 1e-9:
            return 0
        spread = 0.0
        for tokens, seconds, weight, log_rate, log_rate_sq in arms:
            mean = log_rate / weight
            spread += max(log_rate_sq / weight - mean * mean, self.noise_floor ** 2) / weight
        (t0, s0, *_), (t1, s1, *_) = arms
        difference = math.log(t1 / s1) - math.log(t0 / s0) + math.log(drafting_scale)
        if difference > self.z * math.sqrt(spread):
            return 1
        if difference < -self.z * math.sqrt(spread):
            return -1
        return 0
