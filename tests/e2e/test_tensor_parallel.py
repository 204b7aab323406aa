"""vllm-dflash's DFlash with tensor_parallel_size=2 on vLLM's CPU backend.

vLLM's CPU backend runs each TP rank as a worker process. On a 2-core,
one-NUMA-node machine it refuses to start ("Not enough allowed NUMA nodes to
bind threads of 2 local CPUWorkers") unless threads are bound by hand, so
the TP=2 engines get VLLM_CPU_OMP_THREADS_BIND="0|1" (one core per rank).

Two pairs, float32, greedy, ignore_eos, static drafts (their counters do not depend on
how the engine batched the requests), plus the toy pair's adaptive speculation at TP=2 on
the forced "jump" schedule (tokens equal no speculation):

* the bundled toy pair (4 query heads, 2 KV heads: one KV head per rank);
* a tiny random correlated pair with ONE KV head (fewer KV heads than ranks:
  both ranks hold a replica of it).

Checks per pair: TP=2 DFlash tokens equal TP=1 DFlash token for token (and the
toy pair's TP=1 no-speculation output); the TP=2 engine's spec-decode counters (drafts, accepted
tokens, per position) equal TP=1's, so the drafts themselves were the same,
which needs every rank's context K/V in its own heads; and every rank's draft
projects K/V with the checkpoint rows of the heads vLLM's QKVParallelLinear
gives it (the replicated head when KV heads < ranks), as does the fused
context K/V projection that writes context K/V, and its KV cache has those
heads only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from serving_pairs import REPO, TINY_VOCAB, toy_pair
from traffic import long_prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.tp]

MAX_TOKENS = 32
TIMEOUT_S = 1500
SCRIPT = os.path.join(os.path.dirname(__file__), "tp_engines.py")


def tiny_kv1_pair(root: str) -> tuple[str, str]:
    from helpers import correlate_pair, random_draft, save_pair, tiny_target

    target = tiny_target(vocab_size=TINY_VOCAB, num_kv_heads=1, seed=0)
    draft = random_draft(target, num_layers=2, block_size=8, seed=1)
    correlate_pair(target, draft)
    return save_pair(target, draft, root)


def run_engines(runs: list[dict], tmp_path, name: str, env: dict) -> dict:
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(runs))
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]), **env}
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run([sys.executable, SCRIPT, str(spec_file)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=full_env)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    toy_target, toy_draft = toy_pair(str(root / "toy"))
    tiny_target, tiny_draft = tiny_kv1_pair(str(root / "tiny"))
    toy_prompts = [long_prompt_ids(40 + 24 * i)[8 * i:] for i in range(4)]
    tiny_prompts = [[(7 * i + 3 * j) % (TINY_VOCAB - 1) for j in range(6 + 5 * i)] for i in range(4)]
    pairs = {"toy": (toy_target, toy_draft, toy_prompts), "tiny_kv1": (tiny_target, tiny_draft, tiny_prompts)}

    def run_spec(pair: str, tp: int, speculate: bool) -> dict:
        target, draft, prompts = pairs[pair]
        return {"name": f"{pair}/tp{tp}/{'dflash' if speculate else 'none'}", "model": target,
                "draft": draft if speculate else None, "tp": tp, "prompts": prompts, "max_tokens": MAX_TOKENS}

    # TP=1: no speculation once (DFlash TP=1 equals it in every other engine test), DFlash per pair.
    tp1 = [run_spec("toy", 1, False), run_spec("toy", 1, True), run_spec("tiny_kv1", 1, True)]
    tp2 = [run_spec("toy", 2, True), run_spec("tiny_kv1", 2, True)]
    # Adaptive speculation at TP=2 on the forced "jump" schedule: steps without drafting, full blocks
    # and per-request budgets 0..k, rank 0's q broadcast to every rank.
    tp2.append({**run_spec("toy", 2, True), "name": "toy/tp2/adaptive", "adaptive_schedule": "jump"})
    out = run_engines(tp1, root, "tp1", {})
    out.update(run_engines(tp2, root, "tp2", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}))
    return out


@pytest.mark.parametrize("pair", ["toy", "tiny_kv1"])
def test_tp2_dflash_tokens_equal_tp1_and_no_speculation(outputs, pair):
    tp2 = outputs[f"{pair}/tp2/dflash"]["tokens"]
    assert all(len(t) == MAX_TOKENS for t in tp2)
    assert tp2 == outputs[f"{pair}/tp1/dflash"]["tokens"]
    if pair == "toy":
        assert tp2 == outputs["toy/tp1/none"]["tokens"]


def test_tp2_adaptive_tokens_equal_no_speculation(outputs):
    adaptive = outputs["toy/tp2/adaptive"]
    assert adaptive["tokens"] == outputs["toy/tp1/none"]["tokens"]
    counters = adaptive["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0, "the forced schedule verified no draft"
    assert counters["vllm:spec_decode_num_draft_tokens"] < counters["vllm:spec_decode_num_drafts"] * 15, \
        "every draft verified at full length: the per-request budgets were not applied"


@pytest.mark.parametrize("pair", ["toy", "tiny_kv1"])
def test_tp2_drafts_equal_tp1_drafts(outputs, pair):
    tp1, tp2 = outputs[f"{pair}/tp1/dflash"]["counters"], outputs[f"{pair}/tp2/dflash"]["counters"]
    print(f"\n[{pair}] TP=1 counters {tp1}\n[{pair}] TP=2 counters {tp2}")
    assert tp1["vllm:spec_decode_num_accepted_tokens"] > 0, "no draft accepted: the check would not see bad drafts"
    assert tp2 == tp1


@pytest.mark.parametrize("pair,kv_heads_total", [("toy", 2), ("tiny_kv1", 1)])
def test_each_rank_holds_its_own_kv_heads(outputs, pair, kv_heads_total):
    ranks = sorted(outputs[f"{pair}/tp2/dflash"]["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["kv_heads_total"] == kv_heads_total and r["kv_heads_local"] == 1 and r["kv_cache_heads"] == 1, r
        assert r["k_rows_match"] and r["v_rows_match"] and r["context_kv_proj_matches"], r
    heads = [r["heads"] for r in ranks]
    assert heads == ([[0], [1]] if kv_heads_total == 2 else [[0], [0]])  # replicated when heads < ranks
