"""Seconds to write context rows: a fixed part per write and a part per row, fitted online.

The first drafting step after steps without drafting writes the rows they held
back (`serving.context_queue`), and the controller weighs that write before it
turns drafting back on (`BudgetController.switch_pays`, and the price of an
exploring step). A write costs a fixed part (the fc and K/V GEMM calls, the
norms, the cache store) and a part per row. Priced at the mean seconds per row
of recent writes, most of them a drafting step's own handful of rows, held rows
were priced at 14-54 us a row where the slope is ~6 us: a flush of 1,390 rows
measured 8.7 ms and was priced at up to 75 ms (bundled pair, float32, 8
requests in flight, Zen 4 EPYC; writes of 1-38 rows took 0.26-0.64 ms). So both
parts are fitted, by least squares over the writes seen (older ones forgotten),
and held rows are priced at the per-row part alone: the drafting step pays the
fixed part whether or not rows were held. Nothing here is a per-machine
constant: both parts are measured on the running engine.
"""

from __future__ import annotations


class ContextWriteCost:
    """seconds = fixed + per_row * rows over the context writes seen, as forgetting sums."""

    def __init__(self, memory: float = 64.0):
        if memory < 1:
            raise ValueError(f"ContextWriteCost needs memory >= 1, got {memory}")
        self._keep = 1.0 - 1.0 / memory
        # forgetting sums of 1, rows, seconds, rows^2 and rows*seconds
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def add(self, rows: int, seconds: float) -> None:
        """One write of `rows` rows that took `seconds`."""
        if rows <= 0 or not seconds >= 0.0:
            return
        k = self._keep
        self._w = self._w * k + 1.0
        self._n = self._n * k + rows
        self._t = self._t * k + seconds
        self._nn = self._nn * k + float(rows) * rows
        self._nt = self._nt * k + rows * seconds

    def per_row(self) -> float | None:
        """Seconds per extra row (the fitted slope, never negative); None before any write.
        Writes of one size alone cannot split the parts: then the mean per row, which
        overprices rows by the fixed part's share (the safe side for a switch)."""
        if self._w == 0.0:
            return None
        spread = self._w * self._nn - self._n * self._n
        if spread <= 1e-9 * self._w * self._nn:
            return self._nt / self._nn  # one size: the fit through the origin
        slope = (self._w * self._nt - self._n * self._t) / spread
        fixed = (self._t - slope * self._n) / self._w
        if fixed < 0.0:  # no room for a fixed part: the fit through the origin
            return self._nt / self._nn
        return max(slope, 0.0)
