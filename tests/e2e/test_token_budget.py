"""The scheduler's token budget with vllm-dflash's DFlash: prompts get what they get without speculation.

vLLM 0.32 keeps K input slots per scheduled request out of each step's token
budget for DFlash (its in-tree proposer runs the query block in the step's
token buffers); ours does not need them, and the register's
SpeculativeConfig.max_num_new_slots_for_drafting patch gives them back. Two
in-process engines on a tiny random pair with a small budget (64 tokens, 8
requests, k = 7: the reservation alone would be 56 of the 64): one without
speculation, one with adaptive DFlash forced never to draft (the "pause"
schedule over every step). A step that drafts nothing must then be scheduled
exactly as vLLM schedules it without speculation: the same requests and token
counts, step by step, and the same tokens out. With the reservation the first
step scheduled 57 prompt tokens instead of 64, and the runs parted from there.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from serving_pairs import TINY_VOCAB, tiny_pair

K = 7
BUDGET = 64
pytestmark = pytest.mark.vllm


def scheduled_steps(target_dir: str, draft_dir: str | None, prompts: list[list[int]]):
    """(per step (requests, tokens, spec tokens), outputs) of one engine over `prompts`."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from vllm_dflash import envs

    spec = None if draft_dir is None else {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K}
    if spec is not None:
        os.environ[envs.ADAPTIVE_SCHEDULE_ENV] = "pause:0:1000000"
    try:
        llm = LLM(model=target_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=256,
                  max_num_seqs=8, max_num_batched_tokens=BUDGET, enforce_eager=True, gpu_memory_utilization=0.5,
                  enable_prefix_caching=False, speculative_config=spec)
    finally:
        os.environ.pop(envs.ADAPTIVE_SCHEDULE_ENV, None)
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        steps = []
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            steps.append((len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                          sum(len(v) for v in out.scheduled_spec_decode_tokens.values())))
            return out

        scheduler.schedule = recording_schedule
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [s for s in steps if s[1] > 0], [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def test_steps_without_drafts_are_scheduled_as_without_speculation(tmp_path):
    from helpers import random_prompts

    target_dir, draft_dir = tiny_pair(str(tmp_path))
    prompts = random_prompts(16, TINY_VOCAB, min_len=20, max_len=60, seed=3)
    plain_steps, plain_out = scheduled_steps(target_dir, None, prompts)
    dflash_steps, dflash_out = scheduled_steps(target_dir, draft_dir, prompts)
    assert plain_steps[0][1] == BUDGET, plain_steps[:3]  # prompts fill the first step's budget
    assert not any(spec for _, _, spec in dflash_steps), "the pause schedule drafts nothing"
    assert dflash_steps == plain_steps, (f"{len(dflash_steps)} steps with DFlash, {len(plain_steps)} without; "
                                         f"first: {dflash_steps[:4]} vs {plain_steps[:4]}")
    assert dflash_out == plain_out
