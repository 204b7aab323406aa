"""Benchmark figures from raw measurements: pure functions, no vLLM import.

The runner records raw numbers (wall times, per-request timestamps, vLLM's
spec-decode counters); everything derived lives here so it can be unit-tested
and recomputed from a results JSON.

Acceptance conventions follow vLLM's `SpecDecodingLogging`: a *draft* is one
speculation round of one request; the acceptance length of a draft is the
number of accepted draft tokens plus the bonus token, so it lies in [1, k+1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos"
# What the runner records per measurement: vllm_dflash.profiler.step_split
# (seconds of each engine-step phase, and the step count).
TIMED_PARTS = ("step_s", "draft_s", "target_s", "verify_s", "steps")


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default method), NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must lie in [0, 100]")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters at one instant (or a difference of two)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, metrics: Sequence[Any]) -> "SpecCounters":
        """Read `LLM.get_metrics()` output (summing over engines/labels)."""
        out = cls()
        for m in metrics:
            attr = SPEC_COUNTERS.get(m.name)
            if attr is not None:
                setattr(out, attr, getattr(out, attr) + int(m.value))
            elif m.name == PER_POS_COUNTER:
                values = [int(v) for v in m.values]
                if len(out.accepted_per_pos) < len(values):
                    out.accepted_per_pos += [0] * (len(values) - len(out.accepted_per_pos))
                for i, v in enumerate(values):
                    out.accepted_per_pos[i] += v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpecCounters":
        return cls(int(d["num_drafts"]), int(d["num_draft_tokens"]), int(d["num_accepted_tokens"]),
                   [int(v) for v in d["accepted_per_pos"]])

    def to_dict(self) -> dict:
        return asdict(self)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.num_drafts - other.num_drafts,
                            self.num_draft_tokens - other.num_draft_tokens,
                            self.num_accepted_tokens - other.num_accepted_tokens,
                            [x - y for x, y in zip(a, b)])

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.num_drafts + other.num_drafts,
                            self.num_draft_tokens + other.num_draft_tokens,
                            self.num_accepted_tokens + other.num_accepted_tokens,
                            [x + y for x, y in zip(a, b)])


def acceptance(c: SpecCounters) -> dict:
    """Acceptance figures of a counter delta.

    `length_histogram[j]` is the number of drafts whose acceptance length is
    j + 1 (j accepted draft tokens + the bonus token). It is exact, not an
    estimate: vLLM accepts a prefix of each draft, so accepted_per_pos[i]
    counts the drafts with more than i accepted tokens, and the drafts with
    exactly j accepted are accepted_per_pos[j-1] - accepted_per_pos[j].
    """
    if c.num_drafts <= 0:
        return {"num_drafts": 0, "mean_length": math.nan, "draft_acceptance_rate": math.nan,
                "per_position_rate": [], "length_histogram": []}
    pos = c.accepted_per_pos
    if sum(pos) != c.num_accepted_tokens:
        raise ValueError(f"per-position counts sum to {sum(pos)} but num_accepted_tokens is "
                         f"{c.num_accepted_tokens}: counters from different instants?")
    at_least = [c.num_drafts] + list(pos) + [0]
    hist = [at_least[j] - at_least[j + 1] for j in range(len(pos) + 1)]
    if any(h < 0 for h in hist):
        raise ValueError(f"per-position accepted counts {pos} are not non-increasing "
                         f"with {c.num_drafts} drafts; not a prefix-acceptance counter")
    return {
        "num_drafts": c.num_drafts,
        "mean_length": 1.0 + c.num_accepted_tokens / c.num_drafts,
        "draft_acceptance_rate": (c.num_accepted_tokens / c.num_draft_tokens
                                  if c.num_draft_tokens else math.nan),
        "per_position_rate": [p / c.num_drafts for p in pos],
        "length_histogram": hist,
    }


def per_request(histograms: Sequence[Sequence[int]]) -> dict:
    """Per-request acceptance from vLLM's per-request stats (histogram[j] = that
    request's drafts with j accepted tokens): each request's mean acceptance
    length, and the element-wise total over requests."""
    n = max(len(h) for h in histograms)
    total = [sum(h[j] for h in histograms if j < len(h)) for j in range(n)]
    means = [1.0 + sum(j * c for j, c in enumerate(h)) / sum(h) for h in histograms if sum(h) > 0]
    return {"per_request_mean_length": means, "per_request_histogram_total": total}


def request_timing(requests: Sequence[Mapping[str, float]]) -> dict:
    """Latency, TTFT and time per output token from per-request engine timestamps.

    Each request holds queued_ts, first_token_ts, last_token_ts (engine-core
    monotonic clock) and num_output_tokens. TPOT = (last - first) / (n - 1)
    for requests with more than one output token.
    """
    lat = [r["last_token_ts"] - r["queued_ts"] for r in requests]
    ttft = [r["first_token_ts"] - r["queued_ts"] for r in requests]
    tpot = [(r["last_token_ts"] - r["first_token_ts"]) / (r["num_output_tokens"] - 1)
            for r in requests if r["num_output_tokens"] > 1]
    # Per-request speed: its median shrugs off a request slowed by another process.
    speed = [r["num_output_tokens"] / (r["last_token_ts"] - r["queued_ts"])
             for r in requests if r["last_token_ts"] > r["queued_ts"]]
    return {
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": mean(lat),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_ms": mean(tpot) * 1e3, "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "request_tokens_per_s_p50": percentile(speed, 50),
    }


# Positions verified fewer times than this are left out of the calibration error (noise).
CALIBRATION_MIN_VERIFIED = 100


def adaptive_summary(counters: Mapping[str, Any]) -> dict:
    """Figures of adaptive speculation's counters over a measurement
    (`vllm_dflash.adaptive.stats` snapshot difference): decisions, budgets,
    and calibration per draft position (mean predicted survival of verified
    positions vs their realised acceptance)."""
    from vllm_dflash.adaptive.stats import calibration

    steps = sum(counters["steps"].values())
    q_hist, b_hist = list(counters["query_hist"]), list(counters["budget_hist"])
    rows = calibration(counters)
    judged = [r for r in rows if r["verified"] >= CALIBRATION_MIN_VERIFIED]
    return {
        "steps": steps,
        "reasons": dict(counters["steps"]),
        "query_hist": q_hist,
        "budget_hist": b_hist,
        "drafting_share": 1 - q_hist[0] / steps if steps else math.nan,
        "mean_query": sum(q * h for q, h in enumerate(q_hist)) / steps if steps else math.nan,
        "mean_budget": sum(b * h for b, h in enumerate(b_hist)) / sum(b_hist) if sum(b_hist) else math.nan,
        "calibration": rows,
        "calibration_max_error": max((abs(r["predicted"] - r["realised"]) for r in judged), default=math.nan),
    }


def summarize(measurement: Mapping[str, Any]) -> dict:
    """Every figure of one (mode, k, category, concurrency) measurement.

    `measurement` is what the runner writes for one cell: wall_s, prompt_tokens,
    output_tokens, requests (timestamps), counters (delta over the timed
    passes), step_s / draft_s (None when unmeasured).
    """
    wall = float(measurement["wall_s"])
    if wall <= 0:
        raise ValueError(f"wall_s={wall} must be positive")
    out_tok, prompt_tok = int(measurement["output_tokens"]), int(measurement["prompt_tokens"])
    fig = {
        "num_requests": len(measurement["requests"]),
        "wall_s": wall,
        "output_tokens": out_tok,
        "output_tokens_per_s": out_tok / wall,
        "total_tokens_per_s": (out_tok + prompt_tok) / wall,
    }
    fig.update(request_timing(measurement["requests"]))
    fig["time_per_output_token_ms"] = fig["tpot_mean_ms"]
    counters = measurement.get("counters")
    if counters is not None:
        acc = acceptance(SpecCounters.from_dict(counters))
        fig["acceptance"] = acc
        per_req = [r["spec_histogram"] for r in measurement["requests"] if r.get("spec_histogram")]
        if per_req:
            acc.update(per_request(per_req))
            # Two independent vLLM paths (Prometheus counters, per-request stats) must agree.
            acc["per_request_matches_counters"] = acc["per_request_histogram_total"] == acc["length_histogram"]
    step_s, draft_s = measurement.get("step_s"), measurement.get("draft_s")
    if step_s:
        fig["step_s"] = step_s
        fig["draft_s"] = draft_s
        fig["draft_fraction"] = draft_s / step_s
        fig["target_verify_s"] = step_s - draft_s
        steps = measurement.get("steps")
        if steps and measurement.get("target_s") is not None:
            target, verify = measurement["target_s"], measurement.get("verify_s") or 0.0
            fig["steps"] = int(steps)
            # Mean milliseconds per engine step; overhead = the step outside the three parts.
            fig["step_split_ms"] = {
                "target": 1e3 * target / steps, "draft": 1e3 * draft_s / steps,
                "verify": 1e3 * verify / steps, "overhead": 1e3 * (step_s - target - verify - draft_s) / steps,
                "step": 1e3 * step_s / steps}
    if measurement.get("proposer_profile"):
        fig["proposer_profile"] = measurement["proposer_profile"]
    if measurement.get("adaptive"):
        fig["adaptive"] = adaptive_summary(measurement["adaptive"])
    return fig


def _cell_key(c: Mapping[str, Any]) -> tuple:
    """Cells comparable with each other: same dtype, category and concurrency."""
    return c.get("dtype"), c["category"], c["concurrency"]


def add_speedups(cells: list[dict]) -> None:
    """Set `speedup` = output tok/s over mode "none" at the same dtype, category and
    concurrency, and `speedup_p50` = the same ratio of median per-request tok/s (robust to noise)."""
    for key, out in (("output_tokens_per_s", "speedup"), ("request_tokens_per_s_p50", "speedup_p50")):
        base = {_cell_key(c): c.get(key) for c in cells if c["mode"] == "none"}
        for c in cells:
            ref, mine = base.get(_cell_key(c)), c.get(key)
            c[out] = mine / ref if ref and mine is not None and not math.isnan(ref) else math.nan


def match_rate(cells: list[dict]) -> None:
    """Set `outputs_match_none`: the fraction of requests whose token ids equal mode "none"'s.

    Speculative decoding is lossless, so at temperature 0 this should be 1.0
    (floating-point batch effects can flip a near-tie now and then)."""
    base = {_cell_key(c): c.get("output_digests") for c in cells if c["mode"] == "none"}
    for c in cells:
        ref, mine = base.get(_cell_key(c)), c.get("output_digests")
        if not ref or not mine or len(ref) != len(mine):
            c["outputs_match_none"] = None
        else:
            c["outputs_match_none"] = sum(a == b for a, b in zip(ref, mine)) / len(ref)


def merge(measurements: Sequence[Mapping[str, Any]]) -> dict:
    """Pool raw measurements (e.g. every category at one concurrency) into one."""
    if not measurements:
        raise ValueError("merge() needs at least one measurement")
    out: dict[str, Any] = {"wall_s": 0.0, "prompt_tokens": 0, "output_tokens": 0, "requests": [],
                           "output_digests": [],
                           "concurrency": measurements[0].get("concurrency")}
    counters = None
    sums = dict.fromkeys(TIMED_PARTS, 0.0)
    timed = all(m.get("step_s") is not None for m in measurements)
    for m in measurements:
        out["wall_s"] += m["wall_s"]
        out["prompt_tokens"] += m["prompt_tokens"]
        out["output_tokens"] += m["output_tokens"]
        out["requests"] += list(m["requests"])
        out["output_digests"] += list(m.get("output_digests", []))
        if m.get("counters") is not None:
            c = SpecCounters.from_dict(m["counters"])
            counters = c if counters is None else counters + c
        if timed:
            for name in TIMED_PARTS:
                sums[name] += m.get(name) or 0.0
    out["counters"] = counters.to_dict() if counters is not None else None
    adaptive = [m["adaptive"] for m in measurements if m.get("adaptive")]
    if adaptive:
        from vllm_dflash.adaptive.stats import merge as merge_adaptive

        out["adaptive"] = merge_adaptive(adaptive)
    profiles = [m["proposer_profile"] for m in measurements if m.get("proposer_profile")]
    if profiles:
        merged: dict[str, dict] = {}
        for prof in profiles:
            for name, v in prof.items():
                acc = merged.setdefault(name, {"calls": 0, "seconds": 0.0})
                acc["calls"] += v["calls"]
                acc["seconds"] += v["seconds"]
        out["proposer_profile"] = merged
    if timed:
        out.update(sums)
        if not all(m.get("target_s") is not None for m in measurements):
            del out["target_s"]  # an old-format measurement: no split
    return out
