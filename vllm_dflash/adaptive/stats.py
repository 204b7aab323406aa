"""What adaptive speculation decided and how well it predicted, as counters.

`AdaptiveStats` keeps cumulative counters in one float64 vector: steps per
decision reason, the histogram of the drafted query length q per step, the
histogram of per-request budgets (one entry per request per step), and per
draft position j the verified positions, the accepted ones and the sum of
the predicted survival at verification (calibration: predicted vs realised).

With a `path` the vector lives in a memory-mapped file: the worker updates
it in place every step (no serialisation), and any process reads it
(`read_stats`): that is how the numbers cross from the worker to the API
server's /metrics (`adaptive.prometheus`). Pure numpy, no vLLM import.
"""

from __future__ import annotations

import os

import numpy as np

REASONS = ("optimal", "warmup", "explore", "probe", "forced", "off")
_MAGIC, _VERSION = 0x44464C41, 2.0  # "DFLA"; 2: the "off" reason
_HEADER = 3  # magic, version, k


def _layout(k: int) -> dict[str, tuple[int, int]]:
    """name -> (offset, length) in the vector."""
    sizes = [("steps", len(REASONS)), ("query_hist", k + 1), ("budget_hist", k + 1),
             ("verified_per_pos", k), ("accepted_per_pos", k), ("predicted_per_pos", k)]
    out, offset = {}, _HEADER
    for name, n in sizes:
        out[name] = (offset, n)
        offset += n
    return out


def _size(k: int) -> int:
    return sum(n for _, n in _layout(k).values()) + _HEADER


class AdaptiveStats:
    def __init__(self, k: int, path: str | None = None):
        self.k = k
        self.path = path
        size = _size(k)
        if path is None:
            self._vec = np.zeros(size)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # A plain ndarray on the mapped pages: np.memmap's subclass hooks cost tens of
            # microseconds on every small update, and this runs every engine step.
            self._vec = np.memmap(path, dtype=np.float64, mode="w+", shape=(size,)).view(np.ndarray)
        self._vec[:] = 0.0
        self._vec[:_HEADER] = (_MAGIC, _VERSION, k)
        layout = _layout(k)
        self._views = {name: self._vec[o:o + n] for name, (o, n) in layout.items()}
        # Where a step that drafts nothing counts (`record_no_drafts`): its reason's steps, q = 0, budget 0.
        self._reason_cells = {reason: layout["steps"][0] + i for i, reason in enumerate(REASONS)}
        self._no_draft_cells = (layout["query_hist"][0], layout["budget_hist"][0])

    def record_no_drafts(self, requests: int, reason: str = "optimal") -> None:
        """record_step(0, requests, reason) in three scalar updates: the commonest step where
        speculation does not pay (a coasting step), which must cost what a plain step costs."""
        vec, (query, budget) = self._vec, self._no_draft_cells
        vec[self._reason_cells[reason]] += 1.0
        vec[query] += 1.0
        vec[budget] += requests

    def record_step(self, q: int, budgets: np.ndarray | int, reason: str) -> None:
        """A step of query length q and these budgets (an int: that many requests budgeted 0)."""
        v = self._views
        v["steps"][REASONS.index(reason)] += 1
        v["query_hist"][q] += 1
        if type(budgets) is int:
            v["budget_hist"][0] += budgets
        elif budgets.size and q == 0:  # every budget is 0
            v["budget_hist"][0] += budgets.size
        elif budgets.size:
            v["budget_hist"] += np.bincount(np.asarray(budgets, dtype=np.int64), minlength=self.k + 1)[: self.k + 1]

    def record_outcomes(self, predicted: np.ndarray, num_verified: np.ndarray, num_accepted: np.ndarray) -> None:
        """predicted [N, w] survival of verified drafts (padded), with their verified / accepted counts."""
        predicted = np.asarray(predicted, dtype=np.float64)
        v = self._views
        if predicted.shape[0] == 1:  # one request (every step at concurrency 1): three slice updates
            n, a = int(num_verified[0]), int(num_accepted[0])
            v["verified_per_pos"][:n] += 1
            v["accepted_per_pos"][:a] += 1
            v["predicted_per_pos"][:n] += predicted[0, :n]
            return
        width = predicted.shape[1]
        pos = np.arange(width)[None, :]
        verified = pos < np.asarray(num_verified)[:, None]
        accepted = pos < np.asarray(num_accepted)[:, None]
        v["verified_per_pos"][:width] += verified.sum(axis=0)
        v["accepted_per_pos"][:width] += accepted.sum(axis=0)
        v["predicted_per_pos"][:width] += np.where(verified, predicted, 0.0).sum(axis=0)

    def snapshot(self) -> dict:
        return _as_dict(self.k, self._vec)


def _as_dict(k: int, vec: np.ndarray) -> dict:
    out: dict = {"k": k}
    for name, (o, n) in _layout(k).items():
        values = vec[o:o + n]
        out[name] = [float(x) for x in values] if name == "predicted_per_pos" else [int(round(x)) for x in values]
    out["steps"] = dict(zip(REASONS, out["steps"]))
    return out


def read_stats(path: str) -> dict | None:
    """A stats file written by `AdaptiveStats(path=...)`, None if it is not one (yet)."""
    try:
        vec = np.fromfile(path, dtype=np.float64)
    except OSError:
        return None
    if vec.size < _HEADER or vec[0] != _MAGIC or vec[1] != _VERSION:
        return None
    k = int(vec[2])
    if k < 1 or vec.size != _size(k):
        return None
    return _as_dict(k, vec)


def merge(snapshots: list[dict]) -> dict | None:
    """Element-wise sum of snapshots (data-parallel engines), padded to the largest k."""
    if not snapshots:
        return None
    k = max(s["k"] for s in snapshots)
    out: dict = {"k": k, "steps": dict.fromkeys(REASONS, 0)}
    for name, (_, n) in _layout(k).items():
        if name != "steps":
            out[name] = [0.0 if name == "predicted_per_pos" else 0] * n
    for s in snapshots:
        for reason, count in s["steps"].items():
            out["steps"][reason] += count
        for name in out:
            if name in ("k", "steps"):
                continue
            for i, x in enumerate(s[name]):
                out[name][i] += x
    return out


def difference(after: dict, before: dict | None) -> dict:
    """Counter increments between two snapshots (before None: after itself)."""
    if before is None:
        return after
    out: dict = {"k": after["k"], "steps": {r: after["steps"][r] - before["steps"].get(r, 0) for r in REASONS}}
    for name, values in after.items():
        if name in ("k", "steps"):
            continue
        prev = list(before.get(name, [])) + [0] * (len(values) - len(before.get(name, [])))
        out[name] = [a - b for a, b in zip(values, prev)]
    return out


def calibration(s: dict) -> list[dict]:
    """Per position: verified count, mean predicted survival and realised acceptance rate."""
    rows = []
    for j, n in enumerate(s["verified_per_pos"]):
        if n > 0:
            rows.append({"position": j + 1, "verified": n, "predicted": s["predicted_per_pos"][j] / n,
                         "realised": s["accepted_per_pos"][j] / n})
    return rows
