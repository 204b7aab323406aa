"""Seconds of one part of an engine step, measured on the running machine.

`StepCost` learns a time as a function of the number of requests R in the
batch and the tokens per request t, online, from nothing: no per-machine
constants, no batch-size tables. The proposer keeps two:

* the step outside drafting, E(R, t): target forward, logits, verification,
  runner and scheduler overhead, with t = scheduled tokens / R (1 = no
  drafts, k + 1 = full blocks);
* drafting, D(R, t): context-KV write plus the query-block forward and its
  logits, with t = q + 1 (the block [bonus, MASK x q]; q = 0 is the context
  write alone).

Storage: a grid of R knots (geometric) x t knots (1 .. t_max). An
observation is spread over the four surrounding knots (bilinear weights in
R and t); each knot keeps an exponentially forgetting weighted mean
(`memory` observations), and an observation far from its knot's estimate is
clipped to a factor `clip` of it (idle gaps, a stalled process). A
prediction fits t = 1 (no drafts) apart from t >= 2 (a jump: the query
block's forward, verification), smooths each R row over t >= 2 (local straight-line fits, so a knot
measured a few times leans on well-measured neighbours), fits it
non-decreasing in t (weighted pool-adjacent-violators), interpolates linearly between knots that hold data,
extrapolates outside them pessimistically (longer blocks: the last slope, at
least the line through the origin, t / t0 scaling, a cost that grows with the
tokens computed; shorter blocks: on the line from t = 1 to the shortest
measured block, low, so that they get tried and measured, or, where t = 1 is
unknown, that block's cost, flat), and interpolates linearly in R between the nearest rows that hold
data (below the smallest: that row; above the largest: scaled by R). t = 1
at a size that never measured it comes from the sizes that did: interpolated,
or, beyond them, their ratio to the two-token step applied to this size's own.
Nothing is predicted before the first observation (`ready`).
"""

from __future__ import annotations

import bisect
import math

import numpy as np


def request_knots(max_requests: int) -> np.ndarray:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to at least max_requests."""
    knots = [1]
    while knots[-1] < max_requests:
        last = knots[-1]
        knots.append(last + 1 if last < 4 else (last * 3 // 2 if (last & (last - 1)) == 0 else last * 4 // 3))
    return np.array(knots, dtype=np.float64)


def nearest_knot(knots: list[float], requests: float) -> int:
    """Index of the knot nearest to `requests` (the upper one on a tie)."""
    i = bisect.bisect_left(knots, requests)
    if i == len(knots) or (i > 0 and requests - knots[i - 1] < knots[i] - requests):
        i -= 1
    return i


def local_linear(x: np.ndarray, y: np.ndarray, w: np.ndarray, bandwidth: float) -> np.ndarray:
    """Each y smoothed by a weighted straight-line fit over its neighbours (tricube
    kernel, `bandwidth` in x units, widened 1.5x at a time where the neighbours hold
    less than 4 observations' worth of weight), kept within those neighbours' values:
    a knot measured a few times leans on the well-measured ones around it.
    Vectorised over knots and bandwidths."""
    span = float(x[-1] - x[0]) + 1.0
    widths = [bandwidth]
    while widths[-1] <= span:
        widths.append(widths[-1] * 1.5)
    h = np.array(widths)[:, None, None]  # [H, 1, 1]
    d = np.abs(x[:, None] - x[None, :])[None] / h  # [H, i, j]
    k = w[None, None, :] * np.clip(1 - d**3, 0, None) ** 3
    enough = min(4.0, 0.5 * float(w.sum()))
    total = k.sum(axis=2)  # [H, i]
    pick = np.argmax(total >= enough - 1e-12, axis=0)  # the narrowest bandwidth that suffices
    pick = np.where((total >= enough - 1e-12).any(axis=0), pick, len(widths) - 1)
    k = k[pick, np.arange(len(x))]  # [i, j]
    sw = k.sum(axis=1)
    mx, my = (k @ x) / sw, (k @ y) / sw
    dx = x[None, :] - mx[:, None]
    var = (k * dx**2).sum(axis=1)
    cov = (k * dx * (y[None, :] - my[:, None])).sum(axis=1)
    slope = np.where(var > 1e-12, cov / np.where(var > 1e-12, var, 1.0), 0.0)
    # A line fitted to neighbours mostly on one side extrapolates to the knot: at the end
    # of a noisy row it went below zero (a negative no-draft cost, through the fits that
    # lean on this row). A smoothed value stays within the values it was fitted from.
    near = k > 0
    lowest = np.where(near, y[None, :], np.inf).min(axis=1)
    highest = np.where(near, y[None, :], -np.inf).max(axis=1)
    return np.clip(my + slope * (x - mx), lowest, highest)


def pool_adjacent_violators(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of `values`."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.concatenate([np.full(c, v) for v, _, c in blocks])


class StepCost:
    """Online cost surface seconds(R, t); see the module docstring."""

    def __init__(self, max_tokens_per_request: int, max_requests: int, memory: float = 200.0,
                 clip: float = 3.0, min_weight: float = 0.5, bandwidth: float = 3.0):
        if max_tokens_per_request < 1 or max_requests < 1:
            raise ValueError("max_tokens_per_request and max_requests must be >= 1")
        self.r_knots = request_knots(max_requests)
        self._r_list = self.r_knots.tolist()
        self.t_knots = np.arange(1, max_tokens_per_request + 1, dtype=np.float64)
        shape = (len(self.r_knots), len(self.t_knots))
        self.weight = np.zeros(shape)
        self.mean = np.zeros(shape)
        self.memory, self.clip, self.min_weight = float(memory), float(clip), float(min_weight)
        self.bandwidth = float(bandwidth)
        self.observations = 0
        self._queued: list[tuple[int, float, float]] = []
        self._rows: dict[int, np.ndarray | None] = {}
        # (requests, tokens per request) -> the cells a sample there weighs on, (r, t, weight):
        # samples come at few distinct points (most steps repeat the last one's)
        self._cells: dict[tuple[int, float], list[tuple[int, int, float]]] = {}
        # Rows whose cached curve is a fit over t >= 2 (`_row`): a sample at t = 1 moves only its first value
        self._fitted_rows: set[int] = set()
        # Rows whose shortest measured block is longer than t = 2 (`_row`): with t = 1 known, their shorter
        # blocks lie on the line from it (`_line_short_blocks`; row -> the shortest's knot); without, they
        # wait for t = 1 to be lined (a refit)
        self._lined: dict[int, int] = {}
        self._awaiting_line: set[int] = set()

    @property
    def ready(self) -> bool:
        """predict() can answer: some cell holds `min_weight` of evidence. An observation
        between knots splits its weight among up to four cells, so the first ones may leave
        every cell short of it (one step at 5 requests and 1.5 tokens each: four quarters),
        and no row has a curve yet. Counting observations instead crashed a serving step
        (IndexError in `_across_rows`, under chunked prefill with a small token budget)."""
        if self._queued:
            self.fold_queued()
        return bool((self.weight >= self.min_weight).any())

    def _r_corners(self, requests: float) -> list[tuple[int, float]]:
        x = min(max(requests, 1.0), self.r_knots[-1])
        hi = min(bisect.bisect_left(self._r_list, x), len(self.r_knots) - 1)
        if hi == 0 or self.r_knots[hi] == x:
            return [(hi, 1.0)]
        lo = hi - 1
        f = (x - self.r_knots[lo]) / (self.r_knots[hi] - self.r_knots[lo])
        return [(lo, 1.0 - f), (hi, f)]

    def _t_corners(self, tokens: float) -> list[tuple[int, float]]:
        """The t knots a sample at `tokens` per request weighs on. Between 1 and 2 it is a step
        in which some requests verified drafts: it pays the drafting regime's fixed part (the
        rejection sampler, vLLM's glue for drafts), so it goes to t = 2 whole. Split between the
        knots, most of its weight landed on t = 1, the no-draft step, and priced it with part of
        verification's fixed cost (`_curve_at` prices 1 < t < 2 the same way)."""
        t = min(max(tokens, 1.0), self.t_knots[-1])
        if 1.0 < t < 2.0 and len(self.t_knots) > 1:
            return [(1, 1.0)]
        lo = int(math.floor(t)) - 1
        f = t - (lo + 1)
        if f <= 0 or lo + 1 >= len(self.t_knots):
            return [(lo, 1.0)]
        return [(lo, 1.0 - f), (lo + 1, f)]

    def observe(self, requests: int, tokens_per_request: float, seconds: float) -> None:
        """Queue one measurement; it is folded in before the next prediction (a step
        observes every time but predicts rarely, so the knot arithmetic is batched)."""
        if not (seconds > 0 and math.isfinite(seconds)) or requests < 1:
            return
        self._queued.append((requests, tokens_per_request, seconds))
        self.observations += 1

    def fold_queued(self) -> None:
        queued, self._queued = self._queued, []
        for sample in queued:
            self._fold(*sample)

    def _cells_of(self, requests: int, tokens_per_request: float) -> list[tuple[int, int, float]]:
        cells = self._cells.get((requests, tokens_per_request))
        if cells is None:
            cells = [(r, t, wr * wt) for r, wr in self._r_corners(requests)
                     for t, wt in self._t_corners(tokens_per_request) if wr * wt > 0]
            if len(self._cells) < 4096:  # prompt chunks give fractional points: the cache stays bounded
                self._cells[(requests, tokens_per_request)] = cells
        return cells

    def _fold(self, requests: int, tokens_per_request: float, seconds: float) -> None:
        weight, mean, rows = self.weight, self.mean, self._rows
        for r, t, w in self._cells_of(requests, tokens_per_request):
            old_w, old = float(weight[r, t]), float(mean[r, t])
            x = seconds
            if old_w >= 1.0:  # enough evidence here to call a far-off value an outlier
                x = min(max(x, old / self.clip), old * self.clip)
            keep = max(1.0 - w / self.memory, 0.0)
            new_w = old_w * keep + w
            mean[r, t] = (old * old_w * keep + x * w) / new_w
            weight[r, t] = new_w
            curve = rows.get(r) if t == 0 and r in self._fitted_rows and r not in self._awaiting_line else None
            if curve is None:
                rows.pop(r, None)
            elif new_w >= self.min_weight:
                # The fit over t >= 2 does not read t = 1: what a refit would give, without refitting
                # (steps that draft nothing sample only t = 1, and refits were most of a replan then).
                curve = curve.copy()
                if r in self._lined:
                    self._line_short_blocks(r, curve)
                curve[0] = min(float(mean[r, 0]), curve[1])
                rows[r] = curve

    def _row(self, r: int) -> np.ndarray | None:
        """[T] fitted curve of row r over the t knots, None without data.

        t = 1 is a regime of its own (no drafts: no query-block forward, no
        verification), fitted apart from t >= 2: smoothing across the jump
        would raise the no-draft cost by part of the drafting one and make
        speculation look cheaper than it is."""
        if r in self._rows:
            return self._rows[r]
        w = self.weight[r]
        known = w >= self.min_weight
        curve = None
        rest = known.copy()
        rest[0] = False
        self._fitted_rows.discard(r)
        self._lined.pop(r, None)
        self._awaiting_line.discard(r)
        if rest.any():
            curve = self._fit(self.t_knots[rest], self.mean[r][rest], w[rest])
            shortest = int(np.argmax(rest))
            if shortest > 1 and known[0]:
                self._lined[r] = shortest
                self._line_short_blocks(r, curve)
            elif shortest > 1:
                self._awaiting_line.add(r)
            if known[0]:
                curve[0] = min(self.mean[r, 0], curve[1])  # non-decreasing across the jump
            self._fitted_rows.add(r)
        elif known[0]:
            curve = self.mean[r, 0] * self.t_knots  # pessimistic until a longer block is measured
        self._rows[r] = curve
        return curve

    def _line_short_blocks(self, r: int, curve: np.ndarray) -> None:
        """Blocks shorter than row r's shortest measured one, on the straight line from its
        step without drafts (t = 1) to that block: below the truth for a cost with a fixed
        part, so a short block gets tried, and its first measurement replaces the line;
        never below t = 1, so never cheaper than not drafting.

        Priced like the shortest measured block instead (a cost that grows with t is
        bounded by it), a short block never looked worth trying, so it was never measured
        and the price never corrected: warm-up at a new batch size verifies mostly full
        blocks, and at 4 requests after 1 and 2, E(4, 2) read 8.1 ms and D(4, 2) 3.6 ms (the
        long blocks'), against 4.4 and ~2.5 ms where a run happened to measure them. Which
        run did decided the outcome: adaptive 0.93-0.98x of no speculation in one paired
        run, 1.2x in another. With the line: 1.08x (5 calls, 43-82% of steps drafting)
        where the flat price gave 0.98x, and 4, 8 and 16 requests within the calls' noise
        of before (float32 and bfloat16, bundled pair, AVX-512 EPYC)."""
        shortest, first = self._lined[r], float(self.mean[r, 0])
        line = first + (curve[shortest] - first) / shortest * np.arange(1, shortest)
        curve[1:shortest] = np.clip(line, first, curve[shortest])

    def _fit(self, ts: np.ndarray, means: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Smoothed, non-decreasing curve over all t knots from the knots `ts` that hold data."""
        fit = pool_adjacent_violators(local_linear(ts, means, weights, self.bandwidth), weights)
        curve = np.interp(self.t_knots, ts, fit)  # once per row and observation, not per prediction
        below, above = self.t_knots < ts[0], self.t_knots > ts[-1]
        # Shorter blocks than any measured: the shortest measured one's cost, an upper bound
        # (`_row` lowers it to the line from t = 1 where t = 1 is measured). (A line through
        # the origin would price a one-token block at 1/16 of the full block measured in
        # warm-up, when most of a block's cost is fixed: at 64 requests a 1-token draft
        # looked nearly free, below not drafting, and each one cost several plain steps.)
        curve[below] = fit[0]
        if len(ts) >= 2 and ts[-1] > ts[-2]:
            slope = max((fit[-1] - fit[-2]) / (ts[-1] - ts[-2]), fit[-1] / ts[-1])
        else:
            slope = fit[-1] / ts[-1]
        curve[above] = fit[-1] + slope * (self.t_knots[above] - ts[-1])
        return curve

    def predict(self, requests: int, tokens_per_request) -> np.ndarray:
        """Seconds for `requests` requests at each tokens-per-request value (array)."""
        if not self.ready:
            raise RuntimeError("StepCost.predict before any observation (or before any cell holds min_weight "
                               "of evidence); check .ready")
        if self._queued:
            self.fold_queued()
        t = np.maximum(np.asarray(tokens_per_request, dtype=np.float64), 1.0)
        rows = [r for r in range(len(self.r_knots)) if self._row(r) is not None]
        x = float(max(requests, 1))
        out = self._across_rows(rows, x, lambda r: self._curve_at(r, t))
        # t = 1 (no drafts) borrows from the batch sizes where t = 1 itself was
        # measured: a row that only saw drafting steps would otherwise put it on
        # the drafting regime's line through the origin (for drafting: half a
        # block's forward instead of the context write alone).
        first_rows = [r for r in rows if self.weight[r, 0] >= self.min_weight]
        at_first = t == 1.0
        if first_rows and at_first.any() and len(first_rows) < len(rows):
            first = self._across_rows(first_rows, x, lambda r: np.array([self.mean[r, 0]]))[0]
            # Beyond the sizes that measured t = 1, scaling by R makes a step that is mostly
            # fixed cost look R times dearer (no drafting at 8 requests priced at 8 single-request
            # steps: speculation then always looked better). Where a size measured both regimes,
            # its ratio no-draft / two-token step carries to this size's own two-token cost.
            both = [r for r in first_rows if (self.weight[r, 1:] >= self.min_weight).any()]
            if both:
                two = np.array([2.0])
                ratio = self._across_rows(
                    both, x, lambda r: np.array([min(self.mean[r, 0] / self._curve_at(r, two)[0], 1.0)]),
                    scale=False)[0]
                first = min(first, ratio * self._across_rows(rows, x, lambda r: self._curve_at(r, two))[0])
            out = np.where(at_first, np.minimum(first, out.max()), out)
        return out

    def _across_rows(self, rows: list[int], x: float, value_at, scale: bool = True) -> np.ndarray:
        """`value_at(row)` interpolated in R between the nearest rows around x
        (below the smallest: that row; above the largest: scaled by R, unless not `scale`)."""
        below = [r for r in rows if self.r_knots[r] <= x]
        above = [r for r in rows if self.r_knots[r] >= x]
        if below and above:
            lo, hi = below[-1], above[0]
            f = 0.0 if hi == lo else (x - self.r_knots[lo]) / (self.r_knots[hi] - self.r_knots[lo])
            return (1.0 - f) * value_at(lo) + f * value_at(hi)
        if above:  # fewer requests than ever measured: no cheaper than the smallest batch
            return value_at(above[0])
        grow = x / self.r_knots[below[-1]] if scale else 1.0  # more requests: scaled by R
        return value_at(below[-1]) * grow

    def _curve_at(self, r: int, t: np.ndarray) -> np.ndarray:
        """Row r's curve at t >= 1 (knots are 1, 2, ...): linear between knots,
        the last segment's slope past the last one."""
        curve = self._row(r)
        last = len(curve) - 1
        idx = np.minimum(t.astype(np.int64) - 1, max(last - 1, 0))
        if last == 0:
            return curve[0] * t
        frac = t - (idx + 1)
        slope = curve[idx + 1] - curve[idx]
        out = curve[idx] + frac * slope
        # 1 < t < 2: some requests verify drafts, so the step pays the t >= 2
        # regime's fixed part: the t >= 2 line extended back, not a blend with t = 1.
        between = (t > 1.0) & (t < 2.0)
        if between.any():
            back = curve[1] - (2.0 - t) * (curve[2] - curve[1] if last >= 2 else 0.0)
            out = np.where(between, np.maximum(back, curve[0]), out)
        return out
