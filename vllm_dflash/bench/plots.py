"""PNG plots of a bench results JSON (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(cell: dict) -> str:
    k = cell.get("num_spec_tokens")
    name = cell["mode"] if k is None else f"{cell['mode']} k={k}"
    return name if cell.get("dtype") in (None, "auto") else f"{name} {cell['dtype']}"


def _spec_cells(results: list[dict], category: str) -> list[dict]:
    return [c for c in results if c["category"] == category and c.get("acceptance")
            and c["acceptance"].get("num_drafts", 0) > 0]


def speedup_vs_concurrency(results: list[dict], path: str, category: str = "all") -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for c in results:
        if c["category"] == category and c["mode"] != "none" and not math.isnan(c.get("speedup", math.nan)):
            series.setdefault(_label(c), []).append((c["concurrency"], c["speedup"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c["concurrency"] for c in results}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests per batch)")
    ax.set_ylabel("output tok/s / no-spec tok/s")
    ax.set_title(f"Speedup over no speculation ({category})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_histogram(results: list[dict], path: str, category: str = "all", concurrency: int | None = None) -> str:
    """Left: share of drafts per acceptance length (accepted + bonus), one bar group per
    mode. Right: distribution of each request's mean acceptance length."""
    cells = _spec_cells(results, category)
    if concurrency is None and cells:
        concurrency = min(c["concurrency"] for c in cells)
    cells = [c for c in cells if c["concurrency"] == concurrency]
    fig, (ax, ax_req) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(cells), 1)
    for i, c in enumerate(cells):
        hist = c["acceptance"]["length_histogram"]
        total = sum(hist)
        xs = [j + 1 + (i - (len(cells) - 1) / 2) * width for j in range(len(hist))]
        ax.bar(xs, [h / total for h in hist], width=width,
               label=f"{_label(c)} (mean {c['acceptance']['mean_length']:.2f})")
        per_req = c["acceptance"].get("per_request_mean_length")
        if per_req:
            ax_req.hist(per_req, bins=20, range=(1, len(hist)), alpha=0.6, label=_label(c))
    ax.set_xlabel("acceptance length per draft (accepted + bonus)")
    ax.set_ylabel("fraction of drafts")
    ax.set_title(f"Acceptance length ({category}, concurrency {concurrency})")
    ax_req.set_xlabel("mean acceptance length of a request")
    ax_req.set_ylabel("requests")
    ax_req.set_title("Per request")
    if cells:
        ax.legend(fontsize=8)
        ax_req.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def per_position_acceptance(results: list[dict], path: str, category: str = "all",
                            concurrency: int | None = None) -> str:
    """P(draft position i accepted) = share of drafts with more than i accepted tokens."""
    cells = _spec_cells(results, category)
    if concurrency is None and cells:
        concurrency = min(c["concurrency"] for c in cells)
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in (c for c in cells if c["concurrency"] == concurrency):
        rates = c["acceptance"]["per_position_rate"]
        ax.plot(range(1, len(rates) + 1), rates, marker=".", label=_label(c))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"Per-position acceptance ({category}, concurrency {concurrency})")
    if cells:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draft_cost(cost: dict, path: str) -> str:
    """Figure 3: draft time per round vs block size, DFlash vs autoregressive, per layer count."""
    fig, ax = plt.subplots(figsize=(6, 4))
    layers = sorted({r["layers"] for r in cost["rows"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(layers):
        rows = sorted((r for r in cost["rows"] if r["layers"] == n), key=lambda r: r["block_size"])
        bs = [r["block_size"] for r in rows]
        color = colors[i % len(colors)]
        ax.plot(bs, [r["dflash_ms"] for r in rows], marker="o", color=color, label=f"DFlash, {n} layers")
        ax.plot(bs, [r["autoregressive_ms"] for r in rows], marker="s", ls="--", color=color,
                label=f"autoregressive, {n} layers")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["block_size"] for r in cost["rows"]}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("block size B (B-1 draft tokens)")
    ax.set_ylabel("draft time per round (ms)")
    ax.set_title(f"Draft cost, hidden {cost['hidden_size']}, context {cost['context_len']}, "
                 f"{cost['threads']} CPU thread(s)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _adaptive_cells(results: list[dict]) -> list[dict]:
    return [c for c in results if c["category"] == "all" and c.get("adaptive") and c["adaptive"]["steps"]]


def adaptive_budgets(results: list[dict], path: str) -> str:
    """Left: share of per-request verify budgets 0..k; right: share of steps drafting q
    positions; one line per (run, concurrency)."""
    fig, (ax_b, ax_q) = plt.subplots(1, 2, figsize=(11, 4))
    for c in _adaptive_cells(results):
        a = c["adaptive"]
        for ax, hist in ((ax_b, a["budget_hist"]), (ax_q, a["query_hist"])):
            total = sum(hist)
            if total:
                ax.plot(range(len(hist)), [h / total for h in hist], marker=".",
                        label=f"{_label(c)} c={c['concurrency']}")
    ax_b.set_xlabel("draft tokens verified per request and step (budget)")
    ax_b.set_ylabel("share of request-steps")
    ax_b.set_title("Adaptive budgets")
    ax_q.set_xlabel("draft positions drafted per step (q)")
    ax_q.set_ylabel("share of steps")
    ax_q.set_title("Drafted query length")
    for ax in (ax_b, ax_q):
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def adaptive_calibration(results: list[dict], path: str) -> str:
    """Predicted (mean survival at verification) vs realised acceptance per draft position."""
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(_adaptive_cells(results)):
        rows = c["adaptive"]["calibration"]
        if not rows:
            continue
        color = colors[i % len(colors)]
        pos = [r["position"] for r in rows]
        ax.plot(pos, [r["realised"] for r in rows], marker="o", color=color,
                label=f"{_label(c)} c={c['concurrency']} realised")
        ax.plot(pos, [r["predicted"] for r in rows], ls="--", marker="x", color=color, label="predicted")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position (verified)")
    ax.set_ylabel("acceptance")
    ax.set_title("Adaptive calibration: predicted vs realised")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(data: dict, out_dir: str) -> list[str]:
    """Every plot the results support; returns the written paths."""
    paths = []
    results = data.get("results", [])
    if results:
        paths.append(speedup_vs_concurrency(results, os.path.join(out_dir, "speedup_vs_concurrency.png")))
        paths.append(acceptance_histogram(results, os.path.join(out_dir, "acceptance_histogram.png")))
        paths.append(per_position_acceptance(results, os.path.join(out_dir, "per_position_acceptance.png")))
        if _adaptive_cells(results):
            paths.append(adaptive_budgets(results, os.path.join(out_dir, "adaptive_budgets.png")))
            paths.append(adaptive_calibration(results, os.path.join(out_dir, "adaptive_calibration.png")))
    if data.get("draft_cost"):
        paths.append(draft_cost(data["draft_cost"], os.path.join(out_dir, "draft_cost.png")))
    return paths
