"""A step where no request has a draft (adaptive speculation chose none) is verified by
vLLM's sampler alone: the same tokens and logprobs as the full verification path, and no
seeded request's generator moves differently (the next draw is the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_dflash.verifier.sampler import DFlashRejectionSampler

BATCH, VOCAB = 5, 97


def no_draft_metadata(batch: int) -> SpecDecodeMetadata:
    zeros = torch.zeros(batch, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.zeros(0, dtype=torch.int32), num_draft_tokens=[0] * batch,
        cu_num_draft_tokens=zeros, cu_num_sampled_tokens=torch.arange(1, batch + 1, dtype=torch.int32),
        target_logits_indices=torch.zeros(0, dtype=torch.int32),
        bonus_logits_indices=torch.arange(batch, dtype=torch.int32),
        logits_indices=torch.arange(batch, dtype=torch.int32))


def sampling(temperature: list[float], seeds: dict[int, int], logprobs: int | None) -> SamplingMetadata:
    t = torch.tensor(temperature)
    greedy = [x == 0 for x in temperature]
    return SamplingMetadata(
        temperature=None if all(greedy) else t, all_greedy=all(greedy), all_random=not any(greedy),
        top_p=None, top_k=None,
        generators={row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()},
        max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(len(t)), presence_penalties=torch.zeros(len(t)),
        repetition_penalties=torch.ones(len(t)), output_token_ids=[[] for _ in temperature],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in temperature])


@pytest.fixture
def samplers():
    spec = SimpleNamespace(method="dflash", rejection_sample_method="standard")
    ours = DFlashRejectionSampler(Sampler(), spec, torch.device("cpu"))
    assert ours.use_dflash
    return ours


@pytest.mark.parametrize("logprobs", [None, 3])
@pytest.mark.parametrize("temperature,seeds", [([0.0] * BATCH, {}), ([0.0, 1.0, 0.7, 1.0, 0.0], {1: 11, 2: 13, 3: 12})])
def test_no_draft_step_equals_full_verification(samplers, temperature, seeds, logprobs):
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0))
    metadata = no_draft_metadata(BATCH)
    short_meta = sampling(temperature, seeds, logprobs)
    short = samplers(metadata, None, logits.clone(), short_meta)

    full_meta = sampling(temperature, seeds, logprobs)
    full = samplers.verify_drafts(metadata, None, logits.clone(), full_meta)

    assert short.sampled_token_ids.shape == full.sampled_token_ids.shape == (BATCH, 1)
    assert short.sampled_token_ids.dtype == full.sampled_token_ids.dtype
    assert torch.equal(short.sampled_token_ids, full.sampled_token_ids)
    if logprobs is None:
        assert short.logprobs_tensors is None and full.logprobs_tensors is None
    else:
        for a, b in zip(short.logprobs_tensors, full.logprobs_tensors):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-6)
    for row in seeds:  # each seeded generator is left in the same state by both paths
        assert torch.equal(torch.rand(4, generator=short_meta.generators[row]),
                           torch.rand(4, generator=full_meta.generators[row]))
