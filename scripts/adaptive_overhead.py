"""Controller overhead per engine step: what adaptive speculation adds to propose() on the host.

    python scripts/adaptive_overhead.py --requests 1,8,64 --k 15 --steps 2000

Runs `vllm_dflash.adaptive.AdaptiveSpeculation` (outcome matching, calibration
update, step-time sample, plan, posterior survival, budgets, stats) on
synthetic inputs for a steady batch of R requests, after its warm-up, and
prints the mean CPU microseconds per step (thread time, so other processes
on a busy machine do not inflate it) with the machine and its load, once
where verification is cheap (the controller drafts) and once where it is
dear (it stops drafting: the regime where overhead counts most). No
engine: the draft forward and everything vLLM does are not in the figure.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from vllm_dflash.adaptive.speculation import AdaptiveSpeculation
from vllm_dflash.machine import describe


def measure(requests: int, k: int, steps: int, seed: int = 0, verify_cost: float = 2e-4) -> tuple[float, float]:
    """(microseconds per step, share of steps that drafted) with a synthetic step: 2 ms plus
    `verify_cost` seconds per verified token per request outside drafting, and drafting
    0.5 ms plus 0.1 ms per drafted position."""
    rng = np.random.default_rng(seed)
    spec = AdaptiveSpeculation(k, max(requests, 1), seed=seed)
    ids = [f"req-{i}" for i in range(requests)]
    greedy, eligible = np.ones(requests, dtype=bool), np.ones(requests, dtype=bool)
    clock, budgets = 0.0, np.zeros(requests, dtype=np.int64)
    timed, drafted = 0.0, 0
    for step in range(steps + 200):
        verified = budgets  # what the previous step handed out is verified in this step's forward
        accepted = np.minimum(rng.geometric(0.3, size=requests) - 1, verified)
        clock += 2e-3 + verify_cost * verified.sum() / requests  # this step outside drafting
        t0 = time.thread_time()  # CPU time of this thread: other processes on a busy machine stay out
        plan = spec.begin(clock, ids, verified, accepted, requests + int(verified.sum()), greedy, eligible)
        feature = rng.random((requests, plan.q))
        budgets = spec.choose(clock + 1e-3, feature, feature)
        clock += 5e-4 + 1e-4 * plan.q  # this step's drafting
        spec.end(clock)
        if step >= 200:
            timed += time.thread_time() - t0
            drafted += plan.q > 0
    return timed / steps * 1e6, drafted / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,64")
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    print(describe())
    for r in (int(x) for x in args.requests.split(",")):
        for label, verify_cost in (("verification cheap", 2e-4), ("verification dear", 2e-2)):
            us, drafted = measure(r, args.k, args.steps, verify_cost=verify_cost)
            print(f"R={r:3d} k={args.k}, {label}: {us:7.1f} us per step, {100 * drafted:3.0f}% of steps drafted "
                  f"(1-min load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
