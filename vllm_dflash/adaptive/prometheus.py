"""Adaptive-speculation counters in /metrics of `vllm serve` and in `LLM.get_metrics()`.

The numbers live in the worker (the proposer decides budgets and sees the
verification outcomes); /metrics is served by the API server process. The
worker keeps its counters in a memory-mapped file (`stats.AdaptiveStats`)
in the folder named by _VLLM_DFLASH_STATS_DIR, updated in place every step;
a prometheus_client collector in the frontend reads the files when metrics
are collected. `install()` runs at plugin registration in every vLLM
process: in the first one (the frontend, before it starts the engine) the
variable is unset, so it creates the folder and sets the variable, which
engine and worker processes started afterwards inherit; every process
registers the collector in prometheus_client's default REGISTRY, the
registry vLLM's /metrics serves with one API server and
`LLM.get_metrics()` reads.
(With several API servers vLLM serves a multiprocess registry instead; these
metrics are not in it.)

Files are named PID-RANK.bin; files of processes that are gone are ignored,
and a new engine in the same process overwrites its predecessor's file.

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
_installed_pid: int | None = None


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
    """prometheus_client custom collector over `read_all()`."""

    def __init__(self, folder: str):
        self.folder = folder

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = read_all(self.folder)
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


def install() -> None:
    """Called by vllm_dflash.register() in every process; see the module docstring."""
    global _installed_pid
    if _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    folder = envs.stats_dir()
    if folder is None:  # the first vLLM process of this run: the frontend
        folder = tempfile.mkdtemp(prefix="vllm-dflash-stats-")
        envs.set_stats_dir(folder)
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    from prometheus_client import REGISTRY

    # Also in engine and worker processes, where nothing serves it: harmless, and a
    # frontend whose _VLLM_DFLASH_STATS_DIR the user set still gets its collector.

    REGISTRY.register(AdaptiveCollector(folder))
