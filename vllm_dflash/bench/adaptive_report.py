"""The adaptive-speculation acceptance table (issue 10's "Done when"), from bench results.

Input: the results.json of `vllm-dflash bench` runs made in rounds (each
round runs every mode on fresh engines, for each dtype; see
scripts/adaptive_bench.py). Every ratio is taken within a round (modes
measured minutes apart, under the same machine load) and the median over
rounds is judged:

* adaptive >= 0.97x no speculation, every concurrency (all categories pooled);
* adaptive >= 0.95x the best static k, every concurrency; >= 1.0x static
  k = 15 (the largest k) at concurrency 1;
* at concurrency 1, every category (and the mixed one) >= 0.97x no speculation;
* per draft position, predicted acceptance within 0.05 of realised, pooled
  over every adaptive cell of every round (positions verified fewer than
  `CALIBRATION_MIN_VERIFIED` times are shown, not judged).

Where the rounds ran a second engine without speculation (mode none-control),
its ratio to none is shown beside the checks, not judged: two identical
engines differ by a few percent for their whole life, and a check that
misses its bar by less than that spread is within the comparison's noise.

Pure functions (no vLLM): `collect` -> `evaluate` -> `markdown` / `plot`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from vllm_dflash.bench.metrics import CALIBRATION_MIN_VERIFIED

ADAPTIVE, NONE, CONTROL = "dflash-adaptive", "none", "none-control"
VS_NONE, VS_BEST, VS_MAX_K_AT_1, CALIBRATION = 0.97, 0.95, 1.0, 0.05


def run_label(cell: dict) -> str:
    """none, dflash-adaptive, or `dflash k=K` for a static run."""
    if cell["mode"] in (NONE, ADAPTIVE, CONTROL):
        return cell["mode"]
    return f"{cell['mode']} k={cell['num_spec_tokens']}"


def collect(docs: Iterable[tuple[int, dict]]) -> dict:
    """{(dtype, category, concurrency): {label: {round: out tok/s}}} and the adaptive
    counters per round, from (round, results.json document) pairs."""
    tok_s: dict = {}
    adaptive: list[dict] = []
    for rnd, doc in docs:
        for c in doc["results"]:
            key = (c.get("dtype") or doc["config"].get("dtype"), c["category"], c["concurrency"])
            tok_s.setdefault(key, {}).setdefault(run_label(c), {})[rnd] = c["output_tokens_per_s"]
            if c["mode"] == ADAPTIVE and c["category"] != "all" and c.get("adaptive"):
                adaptive.append(c["adaptive"])
    return {"tok_s": tok_s, "adaptive": adaptive}


def _median_ratio(num: dict, den: dict) -> tuple[float, list[float]]:
    """Median over rounds measured in both of num / den, and the per-round ratios."""
    ratios = [num[r] / den[r] for r in sorted(num) if r in den and den[r] > 0]
    return (statistics.median(ratios) if ratios else math.nan), ratios


def _check(name: str, dtype, concurrency, category, value: float, ratios: list[float], bar: float,
           against: str) -> dict:
    return {"check": name, "dtype": dtype, "concurrency": concurrency, "category": category,
            "against": against, "ratio": value, "rounds": ratios, "bar": bar,
            "pass": bool(ratios) and value >= bar}


def pooled_calibration(adaptive: list[dict]) -> list[dict]:
    """Per position: verified count, mean predicted and realised acceptance over all cells."""
    verified: dict[int, float] = {}
    predicted: dict[int, float] = {}
    realised: dict[int, float] = {}
    for a in adaptive:
        for row in a["calibration"]:
            j, n = row["position"], row["verified"]
            verified[j] = verified.get(j, 0) + n
            predicted[j] = predicted.get(j, 0.0) + row["predicted"] * n
            realised[j] = realised.get(j, 0.0) + row["realised"] * n
    return [{"position": j, "verified": int(verified[j]), "predicted": predicted[j] / verified[j],
             "realised": realised[j] / verified[j]} for j in sorted(verified)]


def evaluate(collected: dict) -> dict:
    """Every Done-when check with its median ratio, per-round ratios and PASS/FAIL."""
    tok_s = collected["tok_s"]
    checks = []
    for (dtype, category, conc), runs in sorted(tok_s.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        if ADAPTIVE not in runs or NONE not in runs:
            continue
        ours = runs[ADAPTIVE]
        statics = {label: v for label, v in runs.items() if label not in (ADAPTIVE, NONE, CONTROL)}
        if category == "all":
            if CONTROL in runs:
                value, ratios = _median_ratio(runs[CONTROL], runs[NONE])
                checks.append({**_check("control: second engine without speculation", dtype, conc, category,
                                        value, ratios, VS_NONE, NONE), "pass": None})
            value, ratios = _median_ratio(ours, runs[NONE])
            checks.append(_check("vs no speculation", dtype, conc, category, value, ratios, VS_NONE, NONE))
            if statics:
                # The best static k of each round (the one a user tuning by hand would have picked).
                best = {r: max(v[r] for v in statics.values() if r in v) for r in ours
                        if any(r in v for v in statics.values())}
                value, ratios = _median_ratio(ours, best)
                checks.append(_check("vs best static k", dtype, conc, category, value, ratios, VS_BEST,
                                     "best of " + ", ".join(sorted(statics))))
                if conc == 1:
                    top = max(statics, key=lambda label: int(label.rsplit("=", 1)[1]))
                    value, ratios = _median_ratio(ours, statics[top])
                    checks.append(_check("vs largest static k at c=1", dtype, conc, category, value, ratios,
                                         VS_MAX_K_AT_1, top))
        elif conc == 1:
            value, ratios = _median_ratio(ours, runs[NONE])
            checks.append(_check("category vs no speculation at c=1", dtype, conc, category, value, ratios,
                                 VS_NONE, NONE))
    calibration = pooled_calibration(collected["adaptive"])
    for row in calibration:
        judged = row["verified"] >= CALIBRATION_MIN_VERIFIED
        row["error"] = abs(row["predicted"] - row["realised"])
        row["pass"] = (row["error"] <= CALIBRATION) if judged else None
    judged = [r for r in calibration if r["pass"] is not None]
    return {"checks": checks, "calibration": calibration,
            "all_pass": (all(c["pass"] for c in checks if c["pass"] is not None)
                         and all(r["pass"] for r in judged) and any(c["pass"] is not None for c in checks))}


def _fmt_ratio(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}x"


def markdown(result: dict, machine: str | None = None, load: str | None = None) -> str:
    lines = []
    if machine:
        lines.append(f"Machine: {machine}." + (f" Load: {load}." if load else ""))
        lines.append("")
    lines += ["| check | dtype | conc | category | against | median ratio | per round | bar | result |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in result["checks"]:
        rounds = ", ".join(f"{r:.2f}" for r in c["rounds"])
        verdict = "shown" if c["pass"] is None else "PASS" if c["pass"] else "FAIL"
        bar = "-" if c["pass"] is None else f">= {c['bar']:.2f}"
        lines.append(f"| {c['check']} | {c['dtype']} | {c['concurrency']} | {c['category']} | {c['against']} | "
                     f"{_fmt_ratio(c['ratio'])} | {rounds} | {bar} | {verdict} |")
    lines += ["", f"Calibration per draft position (pooled over every adaptive cell; judged where verified "
                  f">= {CALIBRATION_MIN_VERIFIED} times, bar |predicted - realised| <= {CALIBRATION}):", "",
              "| position | verified | predicted | realised | error | result |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in result["calibration"]:
        verdict = "-" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        lines.append(f"| {r['position']} | {r['verified']} | {r['predicted']:.3f} | {r['realised']:.3f} | "
                     f"{r['error']:.3f} | {verdict} |")
    lines += ["", f"Overall: {'PASS' if result['all_pass'] else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def plot(collected: dict, result: dict, path: str) -> str:
    """Median speedup over no speculation vs concurrency, per dtype: adaptive and each static k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tok_s = collected["tok_s"]
    dtypes = sorted({str(d) for d, cat, _ in tok_s if cat == "all"})
    fig, axes = plt.subplots(1, max(len(dtypes), 1), figsize=(6 * max(len(dtypes), 1), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        series: dict[str, list[tuple[int, float]]] = {}
        for (d, cat, conc), runs in tok_s.items():
            if str(d) != dtype or cat != "all" or NONE not in runs:
                continue
            for label, values in runs.items():
                if label != NONE:
                    series.setdefault(label, []).append((conc, _median_ratio(values, runs[NONE])[0]))
        for label, pts in sorted(series.items()):
            pts.sort()
            style = (dict(lw=2.5, color="black") if label == ADAPTIVE else
                     dict(lw=1, color="gray", ls="--", label="none-control (noise)") if label == CONTROL else
                     dict(lw=1, alpha=0.8))
            style.setdefault("label", label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", **style)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.axhline(VS_NONE, color="red", lw=0.8, ls=":", label=f"{VS_NONE}x bar")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s over no speculation (median of rounds)")
        ax.set_title(f"{dtype}: {'PASS' if result['all_pass'] else 'FAIL'} overall")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
