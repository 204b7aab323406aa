"""The drafter's per-step bookkeeping gives exactly vLLM's outputs: `prepare_next_token_ids_padded`
(next token id and valid-sample count per row; the host path and the accelerator path, run here on
CPU tensors) on random batches with rejected drafts (-1), out-of-vocabulary ids, rows with no valid
sample and discarded rows (partial prefills); `prepare_inputs_padded` (rejected drafts and the last
valid token per request) on random draft counts, against vLLM's CPU kernels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash.serving.drafter_base import DrafterBase, next_tokens_on_device, next_tokens_on_host
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


@pytest.mark.parametrize("path", [next_tokens_on_host, next_tokens_on_device])
@pytest.mark.parametrize("width", [1, 2, 4, 16])
def test_next_token_ids_equal_vllm(width, path):
    rng = np.random.default_rng(width)
    for trial in range(20):
        args = random_batch(rng, int(rng.integers(1, 70)), width)
        expected = vllm_cpu(*args)
        ours = path(*args)
        for want, got in zip(expected, ours):
            assert got.dtype == want.dtype == torch.int32
            assert torch.equal(got, want), (trial, args[0], args[3], want, got)
    # The proposer takes the host path for host tensors.
    args = random_batch(rng, 9, width)
    assert all(torch.equal(a, b) for a, b in zip(DFlashProposer.prepare_next_token_ids_padded(None, *args),
                                                  vllm_cpu(*args)))


def test_rejected_drafts_and_last_valid_token_equal_vllm():
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    from vllm.utils.cpu_triton_utils import _eagle_prepare_inputs_padded_kernel_impl
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rng = np.random.default_rng(0)
    for trial in range(30):
        batch = int(rng.integers(1, 40))
        drafts = rng.integers(0, 16, size=batch) * (rng.random(batch) < 0.7)  # some requests verify none
        prompt = (rng.random(batch) < 0.2) * rng.integers(2, 30, size=batch)  # prompt chunks, no drafts
        drafts[prompt > 0] = 0
        query_lens = np.where(prompt > 0, prompt, drafts + 1)
        valid = np.where(drafts > 0, rng.integers(1, drafts + 2), rng.integers(0, 2, size=batch)).astype(np.int32)
        starts = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
        total = int(starts[-1])
        cu_drafts = torch.tensor(np.cumsum(drafts), dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=starts[1:] + 5,
            num_reqs=batch, num_actual_tokens=total + 3, max_query_len=99, max_seq_len=200,
            block_table_tensor=torch.zeros(batch, 4, dtype=torch.int32),
            slot_mapping=torch.arange(total + 3, dtype=torch.int64), causal=True)
        want_index = torch.empty(batch, dtype=torch.int32)
        want_rejected = torch.empty(batch, dtype=torch.int32)
        _eagle_prepare_inputs_padded_kernel_impl(cu_drafts, torch.tensor(valid), starts, want_index, want_rejected,
                                                 batch)
        step_cad, index, rejected = DrafterBase.prepare_inputs_padded(
            None, cad, SimpleNamespace(cu_num_draft_tokens=cu_drafts), torch.tensor(valid))
        assert torch.equal(rejected, want_rejected) and rejected.dtype == torch.int32, trial
        assert torch.equal(index, want_index) and index.dtype == torch.int32, trial
        assert step_cad.num_actual_tokens == total and step_cad.max_query_len == int(query_lens.max())
        assert torch.equal(step_cad.slot_mapping, cad.slot_mapping[:total]) and step_cad.causal


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


def test_learning_and_planning_are_left_out_of_the_draft_time(monkeypatch):
    """AdaptiveSpeculation.begin (learning, planning) runs in the drafting call but is no part
    of D(R, q + 1): its seconds are counted as not drafting, which end() leaves out."""
    from vllm_dflash.adaptive.controller import Plan
    from vllm_dflash.serving import proposer as proposer_module

    clock = [100.0]
    monkeypatch.setattr(proposer_module.time, "perf_counter", lambda: clock[0])

    class Adaptive:
        schedule = None

        def begin(self, now, req_ids, verified, accepted, num_tokens, greedy, eligible, useful=None):
            clock[0] += 0.004  # a replan
            return Plan(3, "optimal")

    proposer = object.__new__(DFlashProposer)
    proposer.num_speculative_tokens, proposer._tp_size, proposer._not_drafting_seconds = 4, 1, 0.001
    proposer.adaptive = Adaptive()
    proposer.runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b"], spec_token_ids=[[], []]),
        discard_request_mask=SimpleNamespace(np=np.zeros(2, dtype=bool)), requests={})
    metadata = SimpleNamespace(all_greedy=True, generators={})
    q = proposer._begin_adaptive(2, 2, None, metadata, nothing_verified=True, t0=99.0)
    assert q == 3 and proposer._not_drafting_seconds == pytest.approx(0.001 + 0.004)
