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
expected count its budgets were chosen on: a factor on seconds per token,
expected over yielded tokens summed over the cycles (`expected_tokens` /
`tokens`), so a plan whose drafts yield less than promised (acceptance
calibrated on average, but off for this text or batch size) is corrected by
what actually came out, whichever estimate was wrong. A ratio of sums, not a
mean of per-cycle log ratios: one cycle's tokens are noisy (at one request,
1 to 16), and the mean log of expected / yielded exceeds the log of their
means by Jensen's inequality even where the expectation is exact: traced at
one request on code (float32, bundled pair, AVX-512 EPYC), 100 drafting
cycles expected 3.37 tokens and yielded 3.46 on average, while the mean log
ratio priced drafting 1.19x dearer (1.1-1.56x over the run), which held
drafting off in most steps where static k = 15 ran 1.3x faster. A cycle
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
    """Per (batch-size knot, drafted or not): forgetting mean of log(realised / forecast seconds),
    times the ratio of forgetting sums of expected and yielded tokens."""

    def __init__(self, knots, memory: float = 32.0, min_cycles: float = 4.0, clip: float = 4.0,
                 stale_factor: float = 4.0):
        if memory < 1 or min_cycles <= 0 or clip <= 1 or stale_factor < 1:
            raise ValueError("RealizedRatio needs memory >= 1, min_cycles > 0, clip > 1, stale_factor >= 1")
        self.knots = [float(k) for k in knots]
        self.memory, self.min_cycles, self.log_clip = float(memory), float(min_cycles), math.log(clip)
        self.stale_factor = float(stale_factor)
        self._keep, self._fade = 1.0 - 1.0 / self.memory, 1.0 - 1.0 / (self.memory * self.stale_factor)
        # Per knot and kind: [log time sum, weight, expected tokens, yielded tokens, their weight].
        # Python floats: updated every step (numpy scalar indexing made this a fifth of a coasting
        # step's bookkeeping).
        self._sums = [[[0.0] * 5, [0.0] * 5] for _ in self.knots]

    @property
    def log_sum(self) -> np.ndarray:
        """[knots, kind] forgetting sums of log(realised / forecast seconds)."""
        return np.array([[kind[0] for kind in knot] for knot in self._sums])

    @property
    def weight(self) -> np.ndarray:
        """[knots, kind] forgetting cycle counts."""
        return np.array([[kind[1] for kind in knot] for knot in self._sums])

    @property
    def yields(self) -> np.ndarray:
        """[knots, kind, 2] forgetting sums of expected and of yielded tokens."""
        return np.array([[kind[2:4] for kind in knot] for knot in self._sums])

    def key(self, requests: int) -> int:
        """The nearest knot."""
        return nearest_knot(self.knots, requests)

    def observe(self, requests: int, drafted: bool, forecast: float, seconds: float,
                expected_tokens: float = 0.0, tokens: float = 0.0) -> None:
        """One cycle took `seconds` where the curves forecast `forecast` (<= 0: none), and
        yielded `tokens` where `expected_tokens` were expected (either <= 0: time only)."""
        if not (forecast > 0 and seconds > 0 and requests > 0):
            return
        x = min(max(math.log(seconds / forecast), -self.log_clip), self.log_clip)
        counted = 1.0 if expected_tokens > 0 and tokens > 0 else 0.0
        if not counted:
            expected_tokens = tokens = 0.0
        knot, keep, fade = self._sums[self.key(requests)], self._keep, self._fade
        mine, other = knot[int(drafted)], knot[1 - int(drafted)]
        knot[int(drafted)] = [mine[0] * keep + x, mine[1] * keep + 1.0, mine[2] * keep + expected_tokens,
                              mine[3] * keep + tokens, mine[4] * keep + counted]
        # The other kind's evidence goes stale while this kind runs: a factor that once
        # made drafting look bad would otherwise hold speculation off for good (a plan of
        # no draft measures only no-draft cycles; exploration adds a drafting cycle once
        # in a few hundred steps). It fades `stale_factor` times slower than it learns.
        knot[1 - int(drafted)] = [v * fade for v in other]

    def factors(self, requests: int) -> tuple[float, float]:
        """(no-draft, drafting) factors on forecast seconds at this batch size; 1 where unmeasured."""
        knot, least = self._sums[self.key(requests)], self.min_cycles - 1e-6
        no_draft, drafting = (self._factor(*kind) if kind[1] >= least else 1.0 for kind in knot)
        return no_draft, drafting

    def _factor(self, log_sum: float, weight: float, expected: float, tokens: float, yield_weight: float) -> float:
        """Time ratio times yield ratio (once it has `min_cycles` cycles of its own), the
        yield within the clip like each cycle's time."""
        factor = math.exp(log_sum / weight)
        if yield_weight >= self.min_cycles - 1e-6 and expected > 0 and tokens > 0:
            factor *= min(max(expected / tokens, math.exp(-self.log_clip)), math.exp(self.log_clip))
        return factor

    def discount_yields(self, requests: int, keep: float) -> None:
        """The yield evidence at this batch size scaled by `keep`: new requests, new text
        (`NEW_TEXT_KEEP`). How many tokens drafts yield against their expectation depends on
        the text as much as the arms do; the time ratios are the machine's, and stay."""
        for kind in self._sums[self.key(requests)]:
            kind[2], kind[3], kind[4] = kind[2] * keep, kind[3] * keep, kind[4] * keep


def difference_variance(moments, noise_floor: float) -> float:
    """The squared standard error of the difference of two forgetting means of log rates, from
    each one's (weight, sum, sum of squares), each variance at least `noise_floor` squared
    (`ArmRates` per cycle)."""
    spread = 0.0
    for weight, log_rate, log_rate_sq in moments:
        mean = log_rate / weight
        spread += max(log_rate_sq / weight - mean * mean, noise_floor ** 2) / weight
    return spread


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


# The share of the arms' and the yield factor's evidence at a batch size kept when a step's requests are
# all new (none was in the step before; `AdaptiveSpeculation.begin`). Evidence saturates at `memory`
# cycles (32 by default), so this leaves both below their `min_cycles` (6 and 4): the verdict and the
# yield factor wait for cycles of the new requests.
NEW_TEXT_KEEP = 0.1


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
    their error into the arm they mispredict), and compared by a test on the per-cycle log rates:
    `verdict` is +1 (drafting delivers more, by over `z` standard errors), -1 (drafting
    delivers less, by over `stop_z` standard errors) or 0 (either arm has fewer than
    `min_cycles` cycles measured, or the difference is within those bounds). The burden
    of proof is on drafting: not drafting is the safe arm (a lost drafting cycle also
    leaves requests out of step and a held context to write, which no cycle of its own
    shows), so a drafting arm one standard error behind already stops it, and only one
    two errors ahead overrules the curves in its favour. Traced at 8 requests (float32,
    Zen 4 EPYC): drafting at 1050 tok/s against 1277 without, over 14 and 5 cycles, was
    no verdict at two errors either way, and the curves kept drafting.
    An arm that stops running fades `stale_factor` times slower than it learns, as in
    `RealizedRatio`: its faded weight widens the standard error, so a verdict is
    re-examined as its evidence ages (a strong one holds longer than a weak one), not
    kept for good. `min_cycles` counts the cycles measured (forgotten only as the arm's own
    newer cycles come, less what `discount` drops), not their faded weight: gated on the
    weight, a verdict lapsed a few cycles after the 7-step run that measured the other arm,
    however clear it was, and the curves it had overruled decided again.

    What drafting delivers depends on the text: the arms measure the requests that ran. When
    a step's requests are all new (at one request: every new request), their evidence is
    mostly discounted (`discount`): traced at one request on the bundled pair's code prompts
    (float32, AVX-512 EPYC), drafting delivered 880-970 tok/s on some prompts and 390-440 on
    others against ~520 without; the verdict one hard prompt left held drafting off for the
    easy ones that followed (18-36% of steps drafting where static k = 15 ran 1.3x adaptive).
    """

    def __init__(self, knots, memory: float = 32.0, min_cycles: float = 6.0, stale_factor: float = 4.0,
                 z: float = 2.0, stop_z: float = 1.0, noise_floor: float = 0.05):
        if (memory < 1 or min_cycles <= 1 or stale_factor < 1 or z <= 0 or not 0 < stop_z <= z
                or noise_floor <= 0):
            raise ValueError("ArmRates needs memory >= 1, min_cycles > 1, stale_factor >= 1, z > 0, "
                             "0 < stop_z <= z, noise_floor > 0")
        self.knots = [float(k) for k in knots]
        self.memory, self.min_cycles, self.stale_factor = float(memory), float(min_cycles), float(stale_factor)
        self.z, self.stop_z, self.noise_floor = float(z), float(stop_z), float(noise_floor)
        self._keep, self._fade = 1.0 - 1.0 / self.memory, 1.0 - 1.0 / (self.memory * self.stale_factor)
        # Per knot and arm (no draft, draft): forgetting sums of tokens, seconds, cycles, and the
        # per-cycle log rate and its square (the noise). Python floats: read on every step.
        self._sums = [[[0.0] * 5 for _ in range(2)] for _ in self.knots]
        # Per knot and arm: cycles measured, forgotten only as the arm's own newer cycles come
        # (at most `memory`), not faded while the other arm runs; `discount` scales them.
        self._measured = [[0.0, 0.0] for _ in self.knots]

    def observe(self, requests: int, drafted: bool, seconds: float, tokens: float) -> None:
        """A cycle at `requests` that drafted or not yielded `tokens` in `seconds`."""
        if not (seconds > 0 and tokens > 0 and requests > 0):
            return
        knot = nearest_knot(self.knots, requests)
        arms = self._sums[knot]
        measured = self._measured[knot]
        measured[int(drafted)] = measured[int(drafted)] * self._keep + 1.0
        keep, fade, x = self._keep, self._fade, math.log(tokens / seconds)
        t, s, n, lx, lx2 = arms[int(drafted)]
        arms[int(drafted)] = [t * keep + tokens, s * keep + seconds, n * keep + 1.0, lx * keep + x, lx2 * keep + x * x]
        arms[1 - int(drafted)] = [v * fade for v in arms[1 - int(drafted)]]

    def discount(self, requests: int, keep: float) -> None:
        """Both arms' evidence at this batch size scaled by `keep` (new requests: `NEW_TEXT_KEEP`)."""
        knot = nearest_knot(self.knots, requests)
        arms = self._sums[knot]
        for i in range(2):
            arms[i] = [v * keep for v in arms[i]]
        self._measured[knot] = [n * keep for n in self._measured[knot]]

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
        knot = nearest_knot(self.knots, requests)
        arms = self._sums[knot]
        if min(self._measured[knot]) < self.min_cycles - 1e-9:
            return 0
        spread = difference_variance([arm[2:] for arm in arms], self.noise_floor)
        (t0, s0, *_), (t1, s1, *_) = arms
        difference = math.log(t1 / s1) - math.log(t0 / s0) + math.log(drafting_scale)
        if difference > self.z * math.sqrt(spread):
            return 1
        if difference < -self.stop_z * math.sqrt(spread):
            return -1
        return 0
