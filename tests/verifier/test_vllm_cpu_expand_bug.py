"""vLLM 0.32's own rejection sampler is not lossless on CPU for sampled requests.

`vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` (the Triton kernel
`_expand`, which has no CPU backend) returns uninitialized memory on CPU, and
`apply_sampling_constraints` divides the target logits of every draft position
by those values. Sampled (T > 0) requests verified by vLLM's sampler therefore
follow neither the target's distribution nor sensible acceptance (README
"Results": tau 1.00 and answers that never end, or end after ~3 tokens).
vllm-dflash's verifier expands per-request values with `repeat_interleave`
and serves by default; with `VLLM_DFLASH_VERIFIER=vllm` it logs
`VLLM_CPU_SAMPLED_VERIFY_WARNING`.

This test runs vLLM's verifier on the toy pair (in-tree path of the
sampler, T=1) and records every expand call, then shows the consequence for
greedy requests batched with sampled ones (their tokens change). It fails
once vLLM expands correctly: then drop the warning and the README note.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

GREEDY_PROMPTS = 8


class _Calls(list):
    """Recorded expand calls, plus `greedy`: (greedy outputs alone, the same batched with sampled requests)."""

    greedy: tuple = ((), ())


@pytest.fixture(scope="module")
def expand_calls():
    import torch
    import vllm.v1.sample.rejection_sampler as rs
    from engines import vllm_engine
    from serving_pairs import TOY_DRAFT, TOY_TARGET
    from vllm import SamplingParams

    from vllm_dflash.patches import model_runner_of

    calls = _Calls()
    original = rs.expand_batch_to_tokens

    def record(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        out = original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        expected = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        calls.append((out.clone(), expected.repeat_interleave(counts)))
        return out

    rs.expand_batch_to_tokens = record
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_DFLASH_VERIFIER", "vllm")
        try:
            with vllm_engine(model=TOY_TARGET, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                             speculative_config={"method": "dflash", "model": TOY_DRAFT,
                                                 "num_speculative_tokens": 3}) as llm:
                assert model_runner_of(llm).rejection_sampler.use_dflash is False  # vLLM's verifier serves
                llm.generate(["def add(a, b):"], SamplingParams(temperature=1.0, max_tokens=24, seed=1),
                             use_tqdm=False)
                # Greedy requests alone (an all-greedy batch skips the expansion), then batched with sampled ones.
                greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
                sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=2)
                prompts = [f"def f{i}(x):" for i in range(GREEDY_PROMPTS)]
                alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
                mixed = llm.generate(prompts + ["Once upon a time"] * GREEDY_PROMPTS,
                                     [greedy] * GREEDY_PROMPTS + [sampled] * GREEDY_PROMPTS, use_tqdm=False)
                calls.greedy = (alone, [o.outputs[0].token_ids for o in mixed[:GREEDY_PROMPTS]])
        finally:
            rs.expand_batch_to_tokens = original
    return calls


def test_vllm_cpu_expand_batch_to_tokens_returns_garbage(expand_calls):
    import torch

    calls = [(out, want) for out, want in expand_calls if want.numel() > 0]
    assert calls, "vLLM's rejection sampler never expanded a per-request value: the test no longer reaches the bug"
    wrong = [(out.tolist(), want.tolist()) for out, want in calls if not torch.equal(out, want.to(out.dtype))]
    assert wrong, (
        f"vLLM's CPU expand_batch_to_tokens is correct now ({len(calls)} calls): remove "
        "VLLM_CPU_SAMPLED_VERIFY_WARNING (vllm_dflash/verifier/sampler.py) and the README note"
    )


def test_vllm_cpu_verifier_changes_greedy_outputs_batched_with_sampled_ones(expand_calls):
    """Greedy rows of a mixed batch are divided by the garbage temperatures too
    (apply_sampling_constraints scales every row in place before the greedy
    kernel takes its argmax): README and VLLM_CPU_SAMPLED_VERIFY_WARNING say so."""
    alone, mixed = expand_calls.greedy
    assert len(alone) == len(mixed) == GREEDY_PROMPTS
    changed = sum(a != b for a, b in zip(alone, mixed))
    print(f"\nvLLM's CPU verifier: {changed} of {GREEDY_PROMPTS} greedy outputs change when batched with sampled ones")
    assert changed > 0, (
        "vLLM's CPU rejection sampler keeps greedy outputs in mixed batches now: update "
        "VLLM_CPU_SAMPLED_VERIFY_WARNING and the README")
