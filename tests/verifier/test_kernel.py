"""Native rejection-sampling kernels (C++ CPU, CUDA) == the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.verifier import rejection_sample


def random_case(seed: int, k: int, *, batch: int = 24, vocab: int = 257, with_q: bool, external_bonus: bool,
                device: str = "cpu") -> dict:
    """Mixed greedy/sampled rows with 0..k drafts each, zeros in p and q, ties, padded drafts, u = 0."""
    g = torch.Generator().manual_seed(seed)
    num = torch.randint(0, k + 1, (batch,), generator=g)
    num[0] = k
    num_tokens = int(num.sum())
    rows = num_tokens + (0 if external_bonus else batch)
    is_greedy = torch.rand(batch, generator=g) < 0.4
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")  # filtered tokens
    logits[:, 5] = logits[:, 7]  # a tie somewhere
    logits[:, 0] = torch.where(torch.isinf(logits[:, 0]), 0.0, logits[:, 0])  # keep every row non-empty
    row_request = torch.repeat_interleave(torch.arange(batch), num + (0 if external_bonus else 1))
    easy = torch.rand(batch, generator=g) < 0.3  # peaked targets, argmax drafts: runs of accepts
    easy[0] = True
    top = logits.argmax(-1)
    logits[torch.arange(rows), top] += torch.where(easy[row_request], 12.0, 0.0)
    probs = logits.softmax(-1)
    target = torch.where(is_greedy[row_request][:, None], logits, probs)  # greedy rows keep logits

    q = None
    if with_q:
        q_logits = torch.randn(num_tokens, vocab, generator=g) * 2
        q_logits[torch.rand(num_tokens, vocab, generator=g) < 0.3] = float("-inf")
        q_logits[:, 1] = 0.0
        q = q_logits.softmax(-1)
    # Drafts: the target argmax (so greedy rows accept runs), q samples, random ids and -1 padding.
    draft_rows = torch.cat([torch.arange(s, s + n) for s, n in
                            zip((torch.cumsum(num, 0) - num + (0 if external_bonus else torch.arange(batch))).tolist(),
                                num.tolist())]) if num_tokens else torch.zeros(0, dtype=torch.long)
    drafts = target[draft_rows].argmax(-1)
    choice = torch.rand(num_tokens, generator=g)
    if q is not None:
        drafts = torch.where(choice < 0.5, torch.multinomial(q, 1, generator=g)[:, 0], drafts)
    drafts = torch.where((choice > 0.85) & (choice < 0.95), torch.randint(0, vocab, (num_tokens,), generator=g), drafts)
    drafts = torch.where(choice >= 0.97, -1, drafts)
    drafts = torch.where(easy.repeat_interleave(num), target[draft_rows].argmax(-1), drafts)

    uniforms = torch.rand(num_tokens, generator=g, dtype=torch.float64)
    uniforms[torch.rand(num_tokens, generator=g) < 0.05] = 0.0
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    case = dict(
        draft_token_ids=drafts.to(torch.int32), cu_num_draft_tokens=torch.cumsum(num, 0).to(torch.int32),
        target_probs=target, draft_probs=q,
        bonus_token_ids=torch.randint(0, vocab, (batch,), generator=g, dtype=torch.int32) if external_bonus else None,
        is_greedy=is_greedy, uniforms=uniforms, exp_noise=noise, max_spec_len=k)
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in case.items()}


def assert_native_matches_reference(case: dict) -> torch.Tensor:
    native = rejection_sample(**case, impl="native")
    reference = rejection_sample(**case, impl="reference")
    assert native.dtype == torch.int32 and native.device == case["target_probs"].device
    assert torch.equal(native.cpu(), reference.cpu())
    return reference


@pytest.mark.parametrize("k", range(1, 16))
@pytest.mark.parametrize("with_q", [False, True], ids=["point_mass", "draft_probs"])
@pytest.mark.parametrize("external_bonus", [False, True], ids=["bonus_row", "bonus_given"])
def test_cpu_kernel_matches_reference(native_cpu, k, with_q, external_bonus):
    case = random_case(k * 10 + with_q * 2 + external_bonus, k, with_q=with_q, external_bonus=external_bonus)
    out = assert_native_matches_reference(case)
    # The case must exercise acceptance of every draft and rejection, or it proves little.
    num = torch.diff(case["cu_num_draft_tokens"], prepend=torch.zeros(1, dtype=torch.int32))
    emitted = (out != -1).sum(1)
    assert ((emitted == num + 1) & (num > 0)).any()
    assert (emitted <= num).any()

def test_cpu_kernel_all_greedy_and_threads(native_cpu):
    case = random_case(99, 15, batch=64, vocab=8192, with_q=True, external_bonus=False)
    case.update(is_greedy=None, uniforms=None, exp_noise=None)
    assert_native_matches_reference(case)
    case = random_case(98, 15, batch=64, vocab=8192, with_q=True, external_bonus=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rejection_sample(**case, impl="native")
        torch.set_num_threads(2)
        two = rejection_sample(**case, impl="native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_cpu_kernel_empty_batch_and_no_drafts(native_cpu):
    assert_native_matches_reference(random_case(5, 3, batch=1, with_q=False, external_bonus=False))
    case = dict(draft_token_ids=torch.zeros(0, dtype=torch.int32), cu_num_draft_tokens=torch.zeros(3, dtype=torch.int32),
                target_probs=torch.softmax(torch.randn(3, 9), -1), is_greedy=torch.tensor([True, False, False]),
                uniforms=torch.zeros(0, dtype=torch.float64), exp_noise=torch.ones(3, 9), max_spec_len=0)
    out = assert_native_matches_reference(case)
    assert out.shape == (3, 1) and (out >= 0).all()


def test_cpu_kernel_checks_its_arguments(native_cpu):
    case = random_case(1, 2, with_q=False, external_bonus=True)
    with pytest.raises(RuntimeError, match="draft_token_ids must be Int"):
        torch.ops.vllm_dflash.rejection_sample(
            case["draft_token_ids"].long(), case["cu_num_draft_tokens"], case["target_probs"], None,
            case["bonus_token_ids"], None, None, None, 2)
    with pytest.raises(RuntimeError, match="counts <= max_spec_len"):
        torch.ops.vllm_dflash.rejection_sample(
            case["draft_token_ids"], case["cu_num_draft_tokens"], case["target_probs"], None,
            case["bonus_token_ids"], None, None, None, 1)


def test_cuda_kernel_matches_reference(native_cuda):
    """k, vocab (256 / 1024 threads per block), q or point mass, bonus given or sampled, all greedy."""
    for k in (1, 4, 15):
        for vocab in (257, 8192, 151936):
            for with_q in (False, True):
                for external_bonus in (False, True):
                    case = random_case(k + vocab + with_q, k, batch=16, vocab=vocab, with_q=with_q,
                                       external_bonus=external_bonus, device="cuda")
                    assert_native_matches_reference(case)
                    case.update(is_greedy=None, uniforms=None, exp_noise=None)
                    assert_native_matches_reference(case)
