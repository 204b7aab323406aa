"""Controller overhead per engine step: what adaptive speculation adds to propose() on the host.

    python scripts/adaptive_overhead.py --requests 1,8,64 --k 15 --steps 2000

Runs `vllm_dflash.adaptive.AdaptiveSpeculation` (outcome matching, calibration
update, step-time sample, plan, posterior survival, budgets, stats) on
synthetic inputs for a steady batch of R requests, after its warm-up, and
prints the mean microseconds per step with the machine and its load. No
engine: the draft forward and everything vLLM does are not in the figure.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from vllm_dflash.adaptive.speculation import AdaptiveSpeculation
from vllm_dflash.machine import describe


def measure(requests: int, k: int, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    spec = AdaptiveSpeculation(k, max(requests, 1), seed=seed)
    ids = [f"req-{i}" for i in range(requests)]
    greedy, eligible = np.ones(requests, dtype=bool), np.ones(requests, dtype=bool)
    clock, budgets = 0.0, np.zeros(requests, dtype=np.int64)
    timed = 0.0
    for step in range(steps + 200):  # the first 200 steps: warm-up of the controller, not timed
        verified = budgets
        accepted = np.minimum(rng.geometric(0.3, size=requests) - 1, verified)
        t0 = time.perf_counter()
        plan = spec.begin(clock, ids, verified, accepted, requests + int(verified.sum()), greedy, eligible)
        feature = rng.random((requests, plan.q))
        budgets = spec.choose(clock + 1e-3, feature, feature)
        spec.end(clock + 2e-3)
        if step >= 200:
            timed += time.perf_counter() - t0
        clock += 4e-3 + 2e-4 * verified.sum() / requests  # a synthetic step time, growing with verified tokens
    return timed / steps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,64")
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    print(describe())
    for r in (int(x) for x in args.requests.split(",")):
        us = measure(r, args.k, args.steps)
        print(f"R={r:3d} k={args.k}: {us:7.1f} us per step (1-min load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
