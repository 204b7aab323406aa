"""Run vLLM engines one after another and print what test_tensor_parallel compares.

    python tp_engines.py RUNS_JSON

RUNS_JSON: a list of {"name", "model", "draft" (null: no speculation),
"tp", "prompts" (token ids), "max_tokens", optional "adaptive_schedule" (a forced
schedule, VLLM_DFLASH_ADAPTIVE_SCHEDULE; absent: static drafts)}. For each run: greedy token ids,
spec-decode counters, and with tp > 1 what every rank's draft model holds
(`rank_view`, through LLM.collective_rpc). One JSON object on the last stdout line.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def rank_view(worker) -> dict:
    """On one worker: the draft's TP-local attention shapes, and whether its K/V
    projections (the layer's qkv_proj and the fused context_kv_proj) compute the
    checkpoint heads this rank should hold. Probed through the layers: vLLM's
    CPU linears repack their weights after loading."""
    import os  # runs in a worker process: everything it needs is imported here

    import torch
    from safetensors.torch import load_file
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    drafter = worker.model_runner.drafter
    model = drafter.model.model
    attn = model.layers[0].self_attn
    config = drafter.model.config
    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    if config.num_key_value_heads < tp:  # QKVParallelLinear replicates each KV head over tp / heads ranks
        heads = [rank // (tp // config.num_key_value_heads)]
    else:
        heads = list(range(rank * attn.num_kv_heads, (rank + 1) * attn.num_kv_heads))
    rows = torch.cat([torch.arange(h * attn.head_dim, (h + 1) * attn.head_dim) for h in heads])
    ckpt = load_file(os.path.join(drafter.vllm_config.speculative_config.model, "model.safetensors"))
    k_want = ckpt["layers.0.self_attn.k_proj.weight"][rows].float()
    v_want = ckpt["layers.0.self_attn.v_proj.weight"][rows].float()
    x = torch.randn(4, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        qkv = attn.qkv_proj(x)[0].float()
        ctx = model.context_kv_proj(x).float()[:, : 2 * attn.kv_size]  # layer 0's K then V columns
    k_got, v_got = qkv[:, attn.q_size: attn.q_size + attn.kv_size], qkv[:, attn.q_size + attn.kv_size:]
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4))  # noqa: E731
    return {
        "rank": rank, "tp": tp, "kv_heads_total": config.num_key_value_heads, "kv_heads_local": attn.num_kv_heads,
        "heads": heads, "k_rows_match": close(k_got, x @ k_want.T), "v_rows_match": close(v_got, x @ v_want.T),
        "context_kv_proj_matches": close(ctx, torch.cat([k_got, v_got], dim=1)),
        "kv_cache_heads": int(attn.attn.kv_cache.shape[1]),
    }


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
                  gpu_memory_utilization=0.5, tensor_parallel_size=spec["tp"], skip_tokenizer_init=True,
                  disable_log_stats=False)
    if spec["draft"]:
        # Static drafts unless the run names a forced adaptive schedule: the drafts of static speculation
        # depend on each request's own tokens only, so TP=1 and TP=2 counters can be compared; adaptive
        # budgets also depend on how the engine happened to batch the requests.
        schedule = spec.get("adaptive_schedule")
        kwargs["speculative_config"] = {"method": "dflash", "model": spec["draft"], "adaptive": schedule is not None}
        os.environ.pop("VLLM_DFLASH_ADAPTIVE_SCHEDULE", None)
        if schedule is not None:
            os.environ["VLLM_DFLASH_ADAPTIVE_SCHEDULE"] = schedule  # read by the workers this engine starts
    llm = LLM(**kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": {}}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode"):
                result["counters"][metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
        if spec["draft"] and spec["tp"] > 1:
            result["ranks"] = llm.collective_rpc(rank_view)
        return result
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    runs = json.loads(open(sys.argv[1]).read())
    print(json.dumps({spec["name"]: run(spec) for spec in runs}))


if __name__ == "__main__":
    main()
