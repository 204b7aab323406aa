"""Plugin vs in-tree DFlash vs no speculation, interleaved over several rounds.

    python scripts/interleaved_bench.py --rounds 4 --prefix runs/rep2
    python scripts/interleaved_bench.py --rounds 4 --prefix runs/rep2 --summarize-only

One fresh engine process varies by up to ~15% (and a machine period by more) on a
small shared CPU, so a single `vllm-dflash bench` run cannot rank two modes whose
costs differ by less. Each round runs `vllm-dflash bench` once per mode, in the
order none, dflash, dflash-vllm, into PREFIX-<mode>-<round>/; the summary is
the per-round figures and their medians (output tok/s and the engine-step split,
all categories pooled), printed and written to PREFIX-summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = ("none", "dflash", "dflash-vllm")
PARTS = ("step", "target", "draft", "verify", "overhead")


def run_round(args, r: int) -> None:
    for mode in MODES:
        out = f"{args.prefix}-{mode}-{r}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "vllm-dflash"), "bench", "--modes", mode,
               "--num-spec-tokens", str(args.k), "--concurrency", args.concurrency,
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--threads", "1", "--no-plots", "--out", out]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def summarize(args) -> dict:
    cells: dict[str, list] = {}
    for mode in MODES:
        for r in range(1, args.rounds + 1):
            path = f"{args.prefix}-{mode}-{r}/results.json"
            if not os.path.isfile(path):
                continue
            with open(path) as f:
                doc = json.load(f)
            for c in doc["results"]:
                if c["category"] == "all":
                    cells.setdefault(f"{mode}@{c['concurrency']}", []).append(
                        {"round": r, "tok_s": c["output_tokens_per_s"],
                         "tau": (c.get("acceptance") or {}).get("mean_length"),
                         **{p: c["step_split_ms"][p] for p in PARTS}})
    summary = {}
    for key, rows in cells.items():
        med = {p: statistics.median(x[p] for x in rows) for p in ("tok_s",) + PARTS}
        summary[key] = {"rounds": rows, "median": med}
    for key, s in summary.items():
        mode, conc = key.split("@")
        base = summary.get(f"none@{conc}")
        if base:
            s["median"]["speedup"] = s["median"]["tok_s"] / base["median"]["tok_s"]
    print(f"{'mode':12s} {'conc':>4s} {'rounds':>6s} {'tok/s (each round)':>34s} {'median':>8s} {'speedup':>8s}  "
          + "  ".join(f"{p:>8s}" for p in PARTS))
    for key in sorted(summary, key=lambda k: (int(k.split("@")[1]), MODES.index(k.split("@")[0]))):
        mode, conc = key.split("@")
        s = summary[key]
        each = ", ".join(f"{x['tok_s']:.1f}" for x in s["rounds"])
        print(f"{mode:12s} {conc:>4s} {len(s['rounds']):>6d} {each:>34s} {s['median']['tok_s']:8.1f} "
              f"{s['median'].get('speedup', float('nan')):7.2f}x  "
              + "  ".join(f"{s['median'][p]:8.2f}" for p in PARTS))
    with open(f"{args.prefix}-summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--first-round", type=int, default=1)
    p.add_argument("--prefix", default="runs/interleaved")
    p.add_argument("--k", type=int, default=15)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--summarize-only", action="store_true")
    args = p.parse_args()
    if not args.summarize_only:
        for r in range(args.first_round, args.rounds + 1):
            run_round(args, r)
    summarize(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
