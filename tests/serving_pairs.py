"""Target/draft pairs and spec-decode metric readers for the serving tests
(test_serve_openai, test_metrics, test_bf16_greedy, test_sampling_e2e).

* `toy_pair`: the bundled toy target (tokenizer, chat template) with the
  bundled trained drafter `models/toy-draft`; while that drafter is not there
  yet, a random DFlash draft for the toy target (same shapes, accepted rarely).
* `tiny_pair`: a tiny random float32 Qwen3 target (vocab 256, no tokenizer)
  with a random draft correlated with it, so drafts get accepted.
"""

from __future__ import annotations

import json
import os
import socket

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_TARGET = os.path.join(REPO, "models", "toy-target")
TOY_DRAFT = os.path.join(REPO, "models", "toy-draft")
TOY_MASK_TOKEN_ID = 4  # `<|reserved_0|>`, vllm_dflash.zoo.MASK_TOKEN_ID
TINY_VOCAB = 256

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def toy_draft_is_bundled() -> bool:
    return os.path.isfile(os.path.join(TOY_DRAFT, "config.json"))


def toy_pair(root: str) -> tuple[str, str]:
    """(target_dir, draft_dir): the bundled toy pair, or the toy target with a
    random 1-layer draft saved under root when models/toy-draft is missing."""
    if toy_draft_is_bundled():
        return TOY_TARGET, TOY_DRAFT
    import torch
    from helpers import random_draft
    from transformers import AutoConfig

    from vllm_dflash.reference import save_draft

    class _ConfigOnly:  # random_draft reads only target.config
        config = AutoConfig.from_pretrained(TOY_TARGET)

    draft = random_draft(_ConfigOnly(), num_layers=1, block_size=8, seed=1, mask_token_id=TOY_MASK_TOKEN_ID)
    draft_dir = os.path.join(root, "toy-draft-random")
    save_draft(draft.to(torch.bfloat16), draft_dir)
    return TOY_TARGET, draft_dir


def tiny_pair(root: str, block_size: int = 8) -> tuple[str, str]:
    """(target_dir, draft_dir) of a tiny random correlated pair (no tokenizer)."""
    from helpers import correlate_pair, random_draft, save_pair, tiny_target

    target = tiny_target(vocab_size=TINY_VOCAB, seed=0)
    draft = random_draft(target, num_layers=2, block_size=block_size, seed=1)
    correlate_pair(target, draft)
    return save_pair(target, draft, root)


def toy_prompts(n: int) -> list[str]:
    """n held-out toy-target prompts, categories interleaved (code, math, prose, ...)."""
    with open(os.path.join(TOY_TARGET, "eval_prompts.json")) as f:
        by_category = json.load(f)
    interleaved = [p for group in zip(*by_category.values()) for p in group]
    if len(interleaved) < n:
        raise ValueError(f"toy eval_prompts.json holds {len(interleaved)} interleaved prompts, need {n}")
    return interleaved[:n]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_metrics_from_llm(llm) -> dict:
    """{counter name: int, PER_POS: list[int]} from LLM.get_metrics(), summed over engines."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POS] = []
    found = set()
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS and isinstance(metric, Counter):
            out[metric.name] += metric.value
            found.add(metric.name)
        elif metric.name == PER_POS and isinstance(metric, Vector):
            values = out[PER_POS] + [0] * (len(metric.values) - len(out[PER_POS]))
            out[PER_POS] = [a + b for a, b in zip(values, metric.values)]
            found.add(PER_POS)
    missing = set(SPEC_COUNTERS) | {PER_POS}
    missing -= found
    if missing:
        raise AssertionError(f"LLM.get_metrics() lacks {sorted(missing)}")
    return out


def spec_metrics_from_prometheus(text: str) -> dict:
    """The same dict from a /metrics page (Prometheus text format, `_total` counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {name: 0 for name in SPEC_COUNTERS}
    per_pos: dict[int, int] = {}
    found = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_total")
            if base in SPEC_COUNTERS and sample.name.endswith("_total"):
                out[base] += int(sample.value)
                found.add(base)
            elif base == PER_POS and sample.name.endswith("_total"):
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
                found.add(PER_POS)
    missing = (set(SPEC_COUNTERS) | {PER_POS}) - found
    if missing:
        raise AssertionError(f"/metrics lacks {sorted(missing)}")
    out[PER_POS] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)]
    return out


ADAPTIVE_METRICS = {
    "vllm:dflash_adaptive_verified_tokens_per_pos": "verified_per_pos",
    "vllm:dflash_adaptive_accepted_tokens_per_pos": "accepted_per_pos",
    "vllm:dflash_adaptive_predicted_accepted_per_pos": "predicted_per_pos",
}
ADAPTIVE_HISTOGRAMS = {"vllm:dflash_adaptive_budget_tokens": "budget", "vllm:dflash_adaptive_query_tokens": "query"}


def adaptive_metrics_from_llm(llm) -> dict:
    """vllm-dflash's adaptive-speculation metrics from LLM.get_metrics():
    per-position lists, and per histogram {bucket le: cumulative count} with its count and sum."""
    from vllm.v1.metrics.reader import Histogram

    out: dict = {field: {} for field in ADAPTIVE_METRICS.values()}
    for metric in llm.get_metrics():
        if metric.name in ADAPTIVE_METRICS:
            out[ADAPTIVE_METRICS[metric.name]][int(metric.labels["position"])] = metric.value
        elif metric.name in ADAPTIVE_HISTOGRAMS and isinstance(metric, Histogram):
            out[ADAPTIVE_HISTOGRAMS[metric.name]] = {"buckets": dict(metric.buckets), "count": metric.count,
                                                      "sum": metric.sum}
    missing = [name for name, field in {**ADAPTIVE_METRICS, **ADAPTIVE_HISTOGRAMS}.items() if not out.get(field)]
    if missing:
        raise AssertionError(f"LLM.get_metrics() lacks {missing}")
    for field in ADAPTIVE_METRICS.values():
        out[field] = [out[field][i] for i in range(len(out[field]))]
    return out


def adaptive_per_pos_from_prometheus(text: str) -> dict:
    """{field: per-position list} of the adaptive metrics on a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict = {field: {} for field in ADAPTIVE_METRICS.values()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.removesuffix("_total")
            if base in ADAPTIVE_METRICS:
                found[ADAPTIVE_METRICS[base]][int(sample.labels["position"])] = sample.value
    missing = [name for name, field in ADAPTIVE_METRICS.items() if not found[field]]
    if missing:
        raise AssertionError(f"/metrics lacks {missing}")
    return {field: [values[i] for i in range(len(values))] for field, values in found.items()}


def delta(after: dict, before: dict) -> dict:
    """Counter increments between two snapshots."""
    out = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    before_pos = before[PER_POS] + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    out[PER_POS] = [a - b for a, b in zip(after[PER_POS], before_pos)]
    return out


def check_spec_metrics(m: dict, k: int, fixed_length: bool = True) -> float:
    """Consistency of one engine's spec-decode counters; returns the mean
    acceptance length 1 + accepted / drafts (bonus token counted).
    `fixed_length`: every draft holds k tokens (static speculation); adaptive
    drafts hold 1..k."""
    drafts = m["vllm:spec_decode_num_drafts"]
    drafted = m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m[PER_POS]
    assert drafts > 0, m
    if fixed_length:
        assert drafted == drafts * k, f"every draft holds k={k} tokens: {m}"
    else:
        assert drafts <= drafted <= drafts * k, m
    assert 0 <= accepted <= drafted, m
    assert len(per_pos) == k, f"one per-position counter per draft position: {m}"
    assert sum(per_pos) == accepted, m
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), f"per-position counts must not increase: {per_pos}"
    assert per_pos[0] <= drafts, m
    tau = 1 + accepted / drafts
    assert 1.0 <= tau <= k + 1
    return tau
