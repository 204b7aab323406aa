"""Adaptive-speculation counters in /metrics of `vllm serve` and in `LLM.get_metrics()`.

The numbers live in the worker (the proposer decides budgets and sees the
verification outcomes); /metrics is served by the API server process. The
worker keeps its counters in a memory-mapped file (`stats.AdaptiveStats`)
in the folder named by _VLLM_DFLASH_STATS_DIR, updated in place every step;
a prometheus_client collector in the frontend reads the files when metrics
are collected. `start_engine()` runs in the frontend while vLLM builds an
engine's config (patch 4, before the engine processes start): for an
adaptive DFlash engine it creates a fresh folder, sets the variable (engine
and worker processes started afterwards inherit it; an in-process worker
reads it when its proposer is built) and points the collector, registered
once per process in prometheus_client's default REGISTRY, at it: the
registry vLLM's /metrics serves with one API server and `LLM.get_metrics()`
reads. Any other engine config clears both, so an engine never shows a
previous engine's numbers, and a separate `vllm serve` started from a
process that used the plugin does not read that process's workers. (With
several API servers vLLM serves a multiprocess registry instead; these
metrics are not in it.)

Files are named PID-RANK.bin; files of processes that are gone are ignored.

Metrics (positions 0-based, as vLLM's spec-decode per-position counter):
  vllm:dflash_adaptive_steps{reason}                 counter: engine steps per decision kind
  vllm:dflash_adaptive_query_tokens                  histogram: draft positions q drafted per step
  vllm:dflash_adaptive_budget_tokens                 histogram: draft tokens verified per request per step
  vllm:dflash_adaptive_verified_tokens_per_pos{position}  counter
  vllm:dflash_adaptive_accepted_tokens_per_pos{position}  counter
  vllm:dflash_adaptive_predicted_accepted_per_pos{position}  gauge: running sum of the predicted
      acceptance probability of verified positions (a gauge because LLM.get_metrics() reads
      counters as integers); predicted / verified vs accepted / verified is the calibration.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

from vllm_dflash import envs
from vllm_dflash.adaptive import stats as adaptive_stats

_FILE = re.compile(r"^(\d+)-(\d+)\.bin$")


def stats_path(rank: int) -> str | None:
    """Where this worker process writes its counters (None: no folder was set up)."""
    folder = envs.stats_dir()
    return None if folder is None else os.path.join(folder, f"{os.getpid()}-{rank}.bin")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_all(folder: str | None = None) -> dict | None:
    """Counters of every live worker writing to the folder, summed."""
    folder = folder or envs.stats_dir()
    if not folder or not os.path.isdir(folder):
        return None
    snaps = []
    for name in sorted(os.listdir(folder)):
        m = _FILE.match(name)
        if m and _alive(int(m.group(1))):
            snap = adaptive_stats.read_stats(os.path.join(folder, name))
            if snap is not None:
                snaps.append(snap)
    return adaptive_stats.merge(snaps)


class AdaptiveCollector:
    """prometheus_client custom collector over `read_all()` of its folder (None: nothing)."""

    def __init__(self, folder: str | None):
        self.folder = folder

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = read_all(self.folder) if self.folder else None
        if snap is None:
            return
        steps = CounterMetricFamily("vllm:dflash_adaptive_steps", "Engine steps by adaptive decision kind",
                                    labels=["reason"])
        for reason, count in snap["steps"].items():
            steps.add_metric([reason], count)
        yield steps
        for name, field, doc in (
            ("vllm:dflash_adaptive_query_tokens", "query_hist", "Draft positions drafted per step"),
            ("vllm:dflash_adaptive_budget_tokens", "budget_hist", "Draft tokens verified per request per step"),
        ):
            hist = snap[field]
            cumulative, buckets = 0, []
            for value, count in enumerate(hist):
                cumulative += count
                buckets.append((str(value), cumulative))
            buckets.append(("+Inf", cumulative))
            yield HistogramMetricFamily(name, doc, buckets=buckets,
                                        sum_value=float(sum(v * c for v, c in enumerate(hist))))
        per_pos = (
            (CounterMetricFamily, "vllm:dflash_adaptive_verified_tokens_per_pos", "verified_per_pos",
             "Draft tokens verified per draft position"),
            (CounterMetricFamily, "vllm:dflash_adaptive_accepted_tokens_per_pos", "accepted_per_pos",
             "Draft tokens accepted per draft position"),
            (GaugeMetricFamily, "vllm:dflash_adaptive_predicted_accepted_per_pos", "predicted_per_pos",
             "Running sum of the predicted acceptance probability of verified draft tokens per position"),
        )
        for family, name, field, doc in per_pos:
            metric = family(name, doc, labels=["position"])
            for pos, value in enumerate(snap[field]):
                metric.add_metric([str(pos)], value)
            yield metric


_collector: AdaptiveCollector | None = None


def start_engine(adaptive: bool) -> None:
    """Frontend side of a new DFlash engine; see the module docstring."""
    global _collector
    if not adaptive:
        envs.clear_stats_dir()
        if _collector is not None:
            _collector.folder = None
        return
    folder = tempfile.mkdtemp(prefix="vllm-dflash-stats-")
    envs.set_stats_dir(folder)
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    if _collector is None:
        from prometheus_client import REGISTRY

        _collector = AdaptiveCollector(folder)
        REGISTRY.register(_collector)
    else:
        _collector.folder = folder
