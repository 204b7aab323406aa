"""The proposer's CPU `prepare_next_token_ids_padded` gives exactly vLLM's outputs (next token id
and valid-sample count per row) on random batches with rejected drafts (-1), out-of-vocabulary
ids, rows with no valid sample and discarded rows (partial prefills)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.serving.proposer import DFlashProposer

VOCAB = 50


def vllm_cpu(sampled, requests, input_batch, discard):
    """vLLM 0.32's prepare_next_token_ids_padded on CPU: every row's fallback token, then the
    CPU build's C++ kernel (the Triton kernel's replacement)."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils.cpu_triton_utils import _eagle_prepare_next_token_padded_kernel_impl

    batch, width = sampled.shape
    backup = torch.tensor([requests[input_batch.req_ids[i]].get_token_id(int(input_batch.num_tokens_no_spec[i]) - 1)
                           for i in range(batch)], dtype=torch.int32)
    next_ids = torch.empty(batch, dtype=torch.int32)
    valid = torch.empty(batch, dtype=torch.int32)
    _eagle_prepare_next_token_padded_kernel_impl(sampled, discard, backup, next_ids, valid, input_batch.vocab_size,
                                                 width, batch)
    return next_ids, valid


def random_batch(rng: np.random.Generator, batch: int, width: int):
    sampled = rng.integers(0, VOCAB + 3, size=(batch, width))  # ids >= VOCAB are out of vocabulary
    accepted = rng.integers(0, width + 1, size=batch)  # 0: nothing valid in the row
    for row, n in enumerate(accepted):
        sampled[row, n:] = -1
    discard = rng.random(batch) < 0.25
    num_tokens = rng.integers(1, 40, size=batch)
    req_ids = [f"r{row}" for row in range(batch)]
    requests = {rid: SimpleNamespace(get_token_id=lambda idx, row=row: 1000 * (row + 1) + idx)
                for row, rid in enumerate(req_ids)}
    input_batch = SimpleNamespace(num_reqs=batch, req_ids=req_ids, num_tokens_no_spec=num_tokens, vocab_size=VOCAB)
    return (torch.tensor(sampled, dtype=torch.int32), requests, input_batch, torch.tensor(discard))


@pytest.mark.parametrize("width", [1, 2, 4, 16])
def test_cpu_next_token_ids_equal_vllm(width):
    rng = np.random.default_rng(width)
    for trial in range(20):
        args = random_batch(rng, int(rng.integers(1, 70)), width)
        expected = vllm_cpu(*args)
        ours = DFlashProposer.prepare_next_token_ids_padded(SimpleNamespace(), *args)
        for want, got in zip(expected, ours):
            assert got.dtype == want.dtype == torch.int32
            assert torch.equal(got, want), (trial, args[0], args[3], want, got)


def test_useful_drafts_stop_at_max_tokens():
    """Drafting runs before vLLM appends this step's tokens (1 + accepted) to the request
    state: a request with max_tokens 10, 5 tokens out and 2 drafts accepted now ends this
    step at 8, so its next step can use one draft (plus the bonus token); requests without
    a limit (or unknown to the runner) get the full k; none get less than 0."""
    proposer = object.__new__(DFlashProposer)
    proposer.num_speculative_tokens = 4
    state = lambda max_tokens, out: SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens),
                                                    output_token_ids=[7] * out)
    proposer.runner = SimpleNamespace(requests={
        "near": state(10, 5), "far": state(100, 5), "done": state(10, 9), "free": state(None, 3),
        "pooling": SimpleNamespace(sampling_params=None, output_token_ids=[])})
    useful = proposer._useful_drafts(["near", "far", "done", "free", "pooling", "gone"], np.array([2, 2, 0, 0, 0, 0]))
    assert useful.tolist() == [1, 4, 0, 4, 4, 4]
