"""Tabulate the ablation runs of scripts/ablations.sh (issue 3) as Markdown + JSON + PNG.

    python scripts/ablation_table.py [--runs runs/toy-draft/runs] [--out docs/results]

Reads every `ab-*/summary.json` (same data, features, steps and learning rate;
one design axis changed per run) and writes ablations.json / ablations.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

LABELS = {
    "ab-base": "baseline: random anchors, loss decay, 2 layers",
    "ab-fixed": "fixed anchors (aligned grid: blocks tile the response)",
    "ab-fixed-sameblocks": "fixed anchors, 3.5x the steps (about the baseline's blocks)",
    "ab-random-sameblocks": "random anchors, 8 blocks/seq, 3.5x the steps (the row above's blocks and steps)",
    "ab-nodecay": "no loss decay (uniform weights)",
    "ab-L1": "1 draft layer",
    "ab-L3": "3 draft layers",
}
CATEGORIES = ("code", "math", "prose", "all")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/toy-draft/runs")
    p.add_argument("--out", default="docs/results")
    args = p.parse_args()
    rows = []
    for name in LABELS:
        path = os.path.join(args.runs, name, "summary.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            s = json.load(f)
        rows.append({"run": name, "setting": LABELS[name], "steps": s["steps"],
                     "minutes": round(s["minutes"], 1), "parameters": s["draft_parameters"],
                     "blocks": s["blocks_trained"],
                     "val_loss": s["val"]["loss"], "val_acc1": s["val"]["acc1"],
                     "val_acc15": s["val"]["acc"][-1],
                     "tau": {c: s["tau"][c]["tau"] for c in CATEGORIES if c in s["tau"]}})
    extra = sorted(set(glob.glob(os.path.join(args.runs, "ab-*"))) -
                   {os.path.join(args.runs, n) for n in LABELS})
    if extra:
        print("not tabulated (unknown run names):", ", ".join(extra))
    if not rows:
        raise SystemExit(f"no ablation summaries under {args.runs}; run scripts/ablations.sh first")

    print("| run | setting | params | steps | blocks | min | val loss | val acc@1 | val acc@15 | "
          "tau code | tau math | tau prose | tau all |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tau"]
        print(f"| {r['run']} | {r['setting']} | {r['parameters']:,} | {r['steps']} | {r['blocks']:,} | {r['minutes']} | "
              f"{r['val_loss']:.3f} | {r['val_acc1']:.3f} | {r['val_acc15']:.3f} | "
              + " | ".join(f"{t[c]:.2f}" for c in CATEGORIES) + " |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ablations.json"), "w") as f:
        json.dump(rows, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(CATEGORIES))]
        ax.bar(xs, [r["tau"][c] for c in CATEGORIES], width, label=f"{r['setting']} [{r['steps']} steps]")
    ax.set_xticks(range(len(CATEGORIES)), CATEGORIES)
    ax.set_ylabel("acceptance length tau (greedy, B=16)")
    ax.set_title("DFlash ablations on the toy pair (same data and features)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ablations.png"), dpi=120)
    print("wrote", os.path.join(args.out, "ablations.json"), "and ablations.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
