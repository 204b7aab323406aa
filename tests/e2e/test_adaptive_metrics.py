"""Adaptive speculation's metrics in LLM.get_metrics(), against vLLM's own spec-decode counters.

One in-process engine (tiny random correlated float32 pair, k = 7, greedy,
the forced "jump" schedule so that many drafts of mixed lengths are
verified). The worker's counters reach the frontend through a memory-mapped
file and a prometheus collector (vllm_dflash.adaptive.prometheus); vLLM's
counters come from its scheduler. Both describe the same verifications, so
they must agree exactly: draft tokens verified, and accepted per position.
`vllm serve`'s /metrics: tests/test_serve_openai.py.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from serving_pairs import (
    PER_POS,
    TINY_VOCAB,
    adaptive_metrics_from_llm,
    check_spec_metrics,
    delta,
    spec_metrics_from_llm,
    tiny_pair,
)

K = 7
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm_dflash import envs

    target_dir, draft_dir = tiny_pair(str(tmp_path_factory.mktemp("adaptive_metrics")))
    os.environ[envs.ADAPTIVE_SCHEDULE_ENV] = "jump"
    try:
        engine = LLM(model=target_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=256,
                     max_num_seqs=8, enforce_eager=True, gpu_memory_utilization=0.5, disable_log_stats=False,
                     speculative_config={"method": "dflash", "model": draft_dir, "num_speculative_tokens": K})
    finally:
        del os.environ[envs.ADAPTIVE_SCHEDULE_ENV]
    yield engine
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()


def run_batch(llm, seed: int) -> tuple[dict, dict, list[list[int]]]:
    from helpers import random_prompts
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = random_prompts(12, TINY_VOCAB, min_len=4, max_len=30, seed=seed)
    spec0, ours0 = spec_metrics_from_llm(llm), adaptive_metrics_from_llm(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    spec1, ours1 = spec_metrics_from_llm(llm), adaptive_metrics_from_llm(llm)
    ours = {f: [a - b for a, b in zip(ours1[f], ours0[f])]
            for f in ("verified_per_pos", "accepted_per_pos", "predicted_per_pos")}
    for name in ("budget", "query"):
        ours[name] = {"count": ours1[name]["count"] - ours0[name]["count"],
                      "sum": ours1[name]["sum"] - ours0[name]["sum"]}
    return delta(spec1, spec0), ours, [list(o.outputs[0].token_ids) for o in outs]


def test_adaptive_metrics_agree_with_vllms_counters(llm):
    spec, ours, outputs = run_batch(llm, seed=5)
    check_spec_metrics(spec, K, fixed_length=False)
    print(f"\nvLLM: {spec}\nadaptive: {ours}")
    assert sum(ours["verified_per_pos"]) == spec["vllm:spec_decode_num_draft_tokens"] > 0
    vllm_per_pos = spec[PER_POS] + [0] * (K - len(spec[PER_POS]))
    assert ours["accepted_per_pos"] == vllm_per_pos
    assert sum(vllm_per_pos) > 0, "the correlated pair gets drafts accepted: the path must be exercised"
    # Budgets handed out cover what was verified (the scheduler trims only at max_tokens).
    assert ours["budget"]["sum"] >= spec["vllm:spec_decode_num_draft_tokens"]
    assert ours["query"]["count"] > 0 and ours["budget"]["count"] >= ours["query"]["count"]
    for pred, verified in zip(ours["predicted_per_pos"], ours["verified_per_pos"]):
        assert 0 <= pred <= verified
    assert all(len(o) == 40 for o in outputs)


def test_the_file_path_and_the_worker_hold_the_same_numbers(llm):
    """The collector reads the worker's memory-mapped file: its numbers are the
    in-process controller's, not a copy that lags behind."""
    from vllm_dflash.adaptive import prometheus

    run_batch(llm, seed=6)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert prometheus.read_all() == runner.drafter.adaptive.stats.snapshot()
