"""Adaptive speculation vs no speculation vs static k, interleaved rounds on fresh engines.

    python scripts/adaptive_bench.py --rounds 3 --prefix runs/adaptive
    python scripts/adaptive_bench.py --rounds 3 --prefix runs/adaptive --summarize-only

Each round runs, for each dtype, `vllm-dflash bench --interleave` with every
mode (none, static dflash at each --static-k, dflash-adaptive; the order
rotates from round to round; a second engine without speculation, none-control,
unless --no-control) into PREFIX-<dtype>-all-r<round>/: the engines
are fresh each round and take turns pass by pass (--repeats passes a cell),
so each ratio compares measurements seconds apart. The speed of identical
work drifts by +-10% over seconds on a shared machine (one engine repeating
one cell: user CPU time 0.68-0.83 s, no page faults); two engines without
speculation measured one whole cell each in turn differed by 4.9-7.9% (sd of
the log ratio over 15 cells, --waves 3), with two alternating passes of
--waves 2 each by 1.9-2.6% (Zen 4 EPYC, 2 cores). --sequential runs one
`vllm-dflash bench` per mode instead, into PREFIX-<dtype>-<mode>-r<round>/. The sweep covers every concurrency
with the code, math, prose and mixed categories. The summary (`vllm_dflash.bench.adaptive_report`: ratios within
a round, median over rounds, PASS/FAIL per check) is printed and written to
PREFIX-summary.json, PREFIX-summary.md and PREFIX-summary.png, with the
machine, the load average and the wall time of each round.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from tqdm import tqdm

from vllm_dflash.bench import adaptive_report
from vllm_dflash.machine import describe, machine_info


def modes(args, rnd: int = 1) -> list[tuple[str, list[str]]]:
    """(name, extra bench flags) of every engine group of a round (one group with --interleave;
    the order of the modes rotates from round to round)."""
    static = ",".join(str(k) for k in args.static_k)
    if not args.sequential:
        names = ["none", "dflash", "dflash-adaptive"] + (["none-control"] if args.control else [])
        shift = (rnd - 1) % len(names)
        return [("all", ["--modes", ",".join(names[shift:] + names[:shift]), "--num-spec-tokens", static,
                         "--interleave"])]
    return [("none", ["--modes", "none,none-control" if args.control else "none"]),
            ("static", ["--modes", "dflash", "--num-spec-tokens", static]),
            ("adaptive", ["--modes", "dflash-adaptive", "--num-spec-tokens", str(max(args.static_k))])]


def out_dir(args, dtype: str, mode: str, rnd: int) -> str:
    return f"{args.prefix}-{dtype}-{mode}-r{rnd}"


def run_round(args, rnd: int, bar) -> float:
    start = time.perf_counter()
    groups = modes(args, rnd)
    shift = (rnd - 1) % len(groups)
    for dtype in args.dtypes:
        for name, flags in groups[shift:] + groups[:shift]:
            out = out_dir(args, dtype, name, rnd)
            if os.path.isfile(os.path.join(out, "results.json")) and not args.force:
                bar.update(1)
                continue
            cmd = [os.path.join(os.path.dirname(sys.executable), "vllm-dflash"), "bench", *flags,
                   "--dtype", dtype, "--concurrency", args.concurrency, "--num-prompts", str(args.num_prompts),
                   "--max-tokens", str(args.max_tokens), "--batching", args.batching, "--waves", str(args.waves),
                   "--repeats", str(args.repeats),
                   "--mixed", "--threads", str(args.threads),
                   "--no-plots", "--out", out]
            bar.set_postfix_str(f"round {rnd} {dtype} {name}")
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out + ".log", "w") as log:
                subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
            bar.update(1)
    return time.perf_counter() - start


def summarize(args, round_seconds: dict[int, float]) -> dict:
    docs, loads = [], []
    for path in sorted(glob.glob(f"{args.prefix}-*-r*/results.json")):
        rnd = int(path.rsplit("-r", 1)[1].split("/")[0])
        with open(path) as f:
            doc = json.load(f)
        docs.append((rnd, doc))
        env = doc.get("environment", {})
        loads += [v[0] for v in (env.get("loadavg_at_start"), env.get("loadavg_at_end")) if v]
    if not docs:
        raise SystemExit(f"no results under {args.prefix}-*-r*/: run without --summarize-only first")
    collected = adaptive_report.collect(docs)
    result = adaptive_report.evaluate(collected)
    info = docs[0][1]["environment"].get("machine_info") or machine_info()
    load = f"1-min load average {min(loads):.1f}-{max(loads):.1f} over the runs" if loads else None
    text = adaptive_report.markdown(result, describe(info), load)
    print(text)
    summary = {"machine_info": info, "load_range": [min(loads), max(loads)] if loads else None,
               "round_seconds": round_seconds, "rounds": sorted({r for r, _ in docs}),
               "tok_s": {f"{d}|{cat}|{c}": v for (d, cat, c), v in collected["tok_s"].items()}, **result}
    with open(f"{args.prefix}-summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(f"{args.prefix}-summary.md", "w") as f:
        f.write(text)
    adaptive_report.plot(collected, result, f"{args.prefix}-summary.png")
    print(f"Summary: {args.prefix}-summary.json / .md / .png")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=1)
    p.add_argument("--prefix", default="runs/adaptive")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--static-k", default="3,7,15", help="static draft lengths to compare with (the largest is "
                                                         "adaptive's maximum)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--waves", type=int, default=1, help="vllm-dflash bench --waves: at least this many times c "
                   "requests per in-flight cell")
    p.add_argument("--repeats", type=int, default=2, help="vllm-dflash bench --repeats: timed passes per cell; the "
                   "engines' passes alternate, which halved the spread of a cell's ratio between two engines "
                   "without speculation (see the module docstring)")
    p.add_argument("--batching", choices=("in-flight", "waves"), default="in-flight",
                   help="vllm-dflash bench --batching: c requests in flight (default), or batches of c")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="no second engine without speculation (none-control); by default each round runs one, "
                        "and its ratio to none, shown beside the checks, is the comparison's own noise")
    p.add_argument("--force", action="store_true", help="rerun modes whose results already exist")
    p.add_argument("--sequential", action="store_true",
                   help="one engine at a time, mode after mode (the comparisons then span minutes)")
    p.add_argument("--summarize-only", action="store_true")
    args = p.parse_args()
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.static_k = sorted(int(k) for k in args.static_k.split(",") if k)
    round_seconds: dict[int, float] = {}
    if not args.summarize_only:
        rounds = range(args.first_round, args.rounds + 1)
        with tqdm(total=len(rounds) * len(args.dtypes) * len(modes(args)), desc="adaptive bench",
                  unit="run") as bar:
            for rnd in rounds:
                round_seconds[rnd] = run_round(args, rnd, bar)
                tqdm.write(f"round {rnd}: {round_seconds[rnd] / 60:.1f} min, load {os.getloadavg()[0]:.1f}")
    summarize(args, round_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
