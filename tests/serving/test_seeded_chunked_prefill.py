"""Seeded requests with chunked prefills on CPU (vllm_dflash.serving.seed_rewind).

vLLM 0.32 rewinds the generator of a discarded partial-prefill sample with
`Generator.set_offset`, which CPU generators lack: without the plugin's patch
the first seeded request whose prompt is split kills the engine
("CPU Generator does not use offset"), with or without speculation.

* Unit level (no engine): the patched `_sample` / `_bookkeeping_sync` pair
  restores exactly the pre-sampling state of discarded CPU generators, hides
  them from vLLM's offset rewind, leaves other requests' generators advanced,
  and vLLM still has the bug the patch is for.
* Servers (tests/serving/conftest.py): long prompts (PROMPT_LEN tokens, several
  times the small token budgets) with per-request seeds at T=1.
  - no speculation ("plain", budget 64): outputs are the same sent together or
    one at a time, and on a second round;
  - DFlash ("dflash_small", budget 128, and "dflash", default budget, where the
    prompts are not split): one request at a time, the same seed gives the
    same tokens on both servers and on a second round, so the chunked prefill
    changes nothing (DFlash drafts of a seeded request come from its own
    generator: vllm_dflash.serving.proposer). Sent together, DFlash outputs
    may differ: the token budget or a preemption can cut a step's drafts.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from traffic import Request, long_prompt_ids, run_load
from vllm_server import PLAIN_BUDGET, SERVED_NAME, SMALL_BUDGET

from vllm_dflash.serving import seed_rewind

PROMPT_LEN = 300
MAX_TOKENS = 24
SEEDS = (11, 12, 13, 14)


# ------------------------------------------------------------- unit level ----

class _Buffer:
    def __init__(self, values):
        import numpy as np

        self.np = np.array(values, dtype=bool)


class _Batch:
    def __init__(self, generators):
        self.generators = generators
        self.num_reqs = len(generators)


class _Runner:
    def __init__(self, generators, discard):
        self.input_batch = _Batch(generators)
        self.discard_request_mask = _Buffer(discard)


def _vllm_like_bookkeeping(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens):
    """vLLM 0.32's rewind loop (gpu_model_runner._bookkeeping_sync), on what it can see."""
    import numpy as np

    for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
        gen = self.input_batch.generators.get(int(i))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)
    return "bookkept"


def _draw(self, logits, spec_decode_metadata):
    """A step's sampling (and drafting): every generator draws."""
    return {i: torch.rand(8, generator=g) for i, g in self.input_batch.generators.items()}


def test_vllm_still_rewinds_by_offset_which_cpu_generators_lack():
    """The bug the patch is for; fails once vLLM changes it: then re-check and drop the patch."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = inspect.getsource(inspect.unwrap(GPUModelRunner._bookkeeping_sync))
    assert "gen.set_offset(gen.get_offset() - 4)" in source
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()


def test_rewind_restores_discarded_cpu_generators_only():
    gens = {i: torch.Generator().manual_seed(100 + i) for i in range(3)}
    runner = _Runner(gens, [False, True, False])  # request 1: a partial prefill
    fresh = {i: torch.Generator().manual_seed(100 + i) for i in range(3)}

    drawn = seed_rewind.wrap_sample(_draw)(runner, None, None)
    assert seed_rewind.wrap_bookkeeping_sync(_vllm_like_bookkeeping)(runner, None, None, None, None, 0) == "bookkept"
    assert runner.input_batch.generators is gens  # vLLM's dict is back in place
    # Request 1's generator is where it was before the step: its next draw is the discarded one again.
    assert torch.equal(torch.rand(8, generator=gens[1]), drawn[1])
    # The others keep their advance.
    for i in (0, 2):
        torch.rand(8, generator=fresh[i])
        assert torch.equal(torch.rand(8, generator=gens[i]), torch.rand(8, generator=fresh[i]))


def test_bookkeeping_without_snapshot_still_does_not_crash():
    gens = {0: torch.Generator().manual_seed(1)}
    runner = _Runner(gens, [True])
    assert seed_rewind.wrap_bookkeeping_sync(_vllm_like_bookkeeping)(runner, None, None, None, None, 0) == "bookkept"
    with pytest.raises(RuntimeError, match="does not use offset"):  # what vLLM alone does
        _vllm_like_bookkeeping(runner, None, None, None, None, 0)


# ------------------------------------------------------------------ servers ----

def seeded_requests() -> list[Request]:
    ids = long_prompt_ids(PROMPT_LEN + len(SEEDS))
    return [Request(i, "seeded", "completion", {
        "model": SERVED_NAME, "prompt": ids[i:i + PROMPT_LEN], "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        for i, seed in enumerate(SEEDS)]


def outputs(server, concurrency: int) -> list[str]:
    requests = seeded_requests()
    if concurrency == 1:
        results = [run_load(server.url, [r], 1)[0] for r in requests]
    else:
        results = run_load(server.url, requests, concurrency)
    for r in results:
        assert r.complete and r.usage["completion_tokens"] == MAX_TOKENS, (r.status, r.error, r.usage)
    assert server.healthy()
    return [r.text() for r in results]


def test_seeded_chunked_prefill_without_speculation_is_reproducible(toy_servers):
    assert PROMPT_LEN > 4 * PLAIN_BUDGET  # every prompt is prefilled in at least five steps
    server = toy_servers["plain"]
    together = outputs(server, len(SEEDS))
    assert outputs(server, 1) == together
    assert outputs(server, len(SEEDS)) == together
    assert len(set(together)) == len(SEEDS)  # different seeds, different samples


def test_seeded_chunked_prefill_with_dflash_is_reproducible_and_chunking_free(toy_servers):
    assert PROMPT_LEN > 2 * SMALL_BUDGET  # split in three steps on dflash_small, one on dflash
    chunked = outputs(toy_servers["dflash_small"], 1)
    assert outputs(toy_servers["dflash_small"], 1) == chunked
    assert outputs(toy_servers["dflash"], 1) == chunked
    assert len(set(chunked)) == len(SEEDS)
