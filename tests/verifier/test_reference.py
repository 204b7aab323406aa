"""The torch reference verifier on hand-computed cases, plus input checks and noise seeding."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.verifier.draft import sample_drafts

from vllm_dflash.ops.reference import rejection_sample_ref
from vllm_dflash.verifier import draw_noise, rejection_sample, verify
from vllm_dflash.verifier.sampling_params import apply_top_k_top_p, process_logits

NEG = -1


def onehot_rows(argmaxes: list[int], vocab: int) -> torch.Tensor:
    """Target rows whose argmax is given (probabilities, not one-hot, to catch sloppy argmax)."""
    rows = torch.full((len(argmaxes), vocab), 0.1)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return rows / rows.sum(-1, keepdim=True)


def test_greedy_hand_example():
    # req 0: drafts [2, 1, 3], target argmax [2, 1, 0 | bonus 3] -> accept 2, 1, reject 3, emit 0
    # req 1: drafts [3], target argmax [3 | bonus 2] -> accept 3, bonus 2
    # req 2: no drafts, bonus argmax 1
    target = onehot_rows([2, 1, 0, 3, 3, 2, 1], vocab=4)
    out = rejection_sample_ref(
        torch.tensor([2, 1, 3, 3], dtype=torch.int32), torch.tensor([3, 4, 4], dtype=torch.int32),
        target, None, None, None, None, None, max_spec_len=3)
    assert out.dtype == torch.int32
    assert out.tolist() == [[2, 1, 0, NEG], [3, 2, NEG, NEG], [1, NEG, NEG, NEG]]


def test_greedy_external_bonus_and_ties():
    # Ties go to the lowest index, like torch.argmax; the caller's bonus is used when all accept.
    target = torch.tensor([[0.4, 0.4, 0.2], [0.1, 0.3, 0.6]])
    out = rejection_sample_ref(
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
        target, None, torch.tensor([7, 8], dtype=torch.int32), None, None, None, max_spec_len=2)
    assert out.tolist() == [[0, 7, NEG], [2, 8, NEG]]
    target[0] = torch.tensor([0.2, 0.4, 0.4])
    out = rejection_sample_ref(
        torch.tensor([2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
        target[:1], None, torch.tensor([7], dtype=torch.int32), None, None, None, max_spec_len=1)
    assert out.tolist() == [[1, NEG]]


def sampled_call(draft, target, q, u, noise, bonus=None):
    return rejection_sample_ref(
        torch.tensor(draft, dtype=torch.int32), torch.tensor([len(draft)], dtype=torch.int32),
        torch.tensor(target), None if q is None else torch.tensor(q), bonus,
        torch.tensor([False]), torch.tensor(u, dtype=torch.float64), torch.tensor([noise]),
        max_spec_len=len(draft)).tolist()[0]


def test_sampled_hand_example():
    p = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    q = [[0.2, 0.6, 0.2]]
    # Draft 1: accept iff u * 0.6 < 0.3, i.e. u < 0.5.
    # Rejected: residual max(p - q, 0) = [0.3, 0, 0] -> token 0 whatever the noise.
    assert sampled_call([1], p, q, [0.6], [1.0, 1e-6, 1e-6]) == [0, NEG]
    # Accepted: bonus = argmax p_1 / e: [0.1, 0.1, 0.8] / [1, 1, 1] -> 2; with e_0 = 0.01 -> 0.
    assert sampled_call([1], p, q, [0.4], [1.0, 1.0, 1.0]) == [1, 2]
    assert sampled_call([1], p, q, [0.4], [0.01, 1.0, 1.0]) == [1, 0]


def test_point_mass_hand_example():
    p = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    # q = one-hot(0): accept iff u < p(0) = 0.5.
    assert sampled_call([0], p, None, [0.49], [1.0, 1.0, 1.0]) == [0, 2]
    # Rejected: p without token 0 = [0, 0.3, 0.2]; / e = [.., 0.3, 0.4] -> 2, never 0.
    assert sampled_call([0], p, None, [0.5], [1.0, 1.0, 0.5]) == [2, NEG]
    assert sampled_call([0], p, None, [0.5], [1e-9, 1.0, 1.0]) == [1, NEG]


def test_padded_draft_is_rejected_and_resampled_from_p():
    p = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    assert sampled_call([-1], p, None, [0.0], [1.0, 0.1, 1.0]) == [1, NEG]
    assert sampled_call([-1], p, [[0.0, 0.0, 1.0]], [0.0], [1.0, 1.0, 0.1]) == [2, NEG]


def test_draft_outside_target_support_is_never_accepted():
    p = [[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]]
    assert sampled_call([2], p, [[0.0, 0.0, 1.0]], [0.0], [1.0, 1.0, 1.0]) == [0, NEG]


def test_mixed_batch_greedy_and_sampled_rows():
    # Row 0 greedy (draft 1 matches argmax 1, then rejects), row 1 sampled point mass with u = 0.
    target = torch.tensor([[0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.3, 0.3, 0.4],
                           [0.2, 0.7, 0.1], [0.1, 0.1, 0.8]])
    out = rejection_sample_ref(
        torch.tensor([1, 2, 1], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32), target,
        None, None, torch.tensor([True, False]), torch.tensor([0.9, 0.9, 0.0], dtype=torch.float64),
        torch.ones(2, 3), max_spec_len=2)
    # Row 0: accept 1, reject 2 (argmax row 1 = 0) -> [1, 0]. Row 1: accept 1 (u = 0 < 0.7), bonus argmax 2.
    assert out.tolist() == [[1, 0, NEG], [1, 2, NEG]]


def test_verify_greedy_is_argmax_chain():
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    argmax = logits.argmax(-1)
    drafts = argmax[[0, 1, 3, 4]].clone()
    drafts[1] = (drafts[1] + 1) % 11  # request 0 rejects at its second draft
    out = verify(drafts, [3, 1], logits, temperature=None)
    assert out.tolist() == [[int(argmax[0]), int(argmax[1]), NEG, NEG],
                            [int(argmax[4]), int(argmax[5]), NEG, NEG]]


def test_verify_temperature_zero_rows_match_greedy_in_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    drafts = logits.argmax(-1)[[0, 1, 2, 4, 5, 6]]
    temperature = torch.tensor([0.0, 1.0])
    out = verify(drafts, [3, 3], logits, temperature=temperature, top_k=torch.tensor([2, 50]))
    assert out[0].tolist() == logits.argmax(-1)[:4].tolist()


def test_top_k_top_p_semantics():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    kept = apply_top_k_top_p(logits.clone(), torch.tensor([2]), None).isfinite()
    assert kept.tolist() == [[False, True, False, True, False]]  # ties at the k-th value stay
    kept = apply_top_k_top_p(logits.clone(), torch.tensor([3]), None).isfinite()
    assert kept.tolist() == [[False, True, True, True, False]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = apply_top_k_top_p(probs.clone(), None, torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p(probs.clone(), None, torch.tensor([0.1])).isfinite()
    assert kept.tolist() == [[True, False, False, False]]  # at least one token


def test_min_p_and_temperature_order():
    # probs after T=1: [0.6, 0.3, 0.1]: min_p 0.25 keeps tokens with p >= 0.15.
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    kept = process_logits(logits.clone(), torch.tensor([1.0]), min_p=torch.tensor([0.25])).isfinite()
    assert kept.tolist() == [[True, True, False]]
    # T=0.5 squares the odds first (0.36 : 0.09 : 0.01), so only token 0 stays.
    kept = process_logits(logits.clone(), torch.tensor([0.5]), min_p=torch.tensor([0.25])).isfinite()
    assert kept.tolist() == [[True, False, False]]


def test_seeded_noise_is_reproducible_and_independent_of_the_batch():
    def draws(counts, seeded_row):
        gen = torch.Generator().manual_seed(1234)
        return draw_noise(counts, 16, {seeded_row: gen}, "cpu")

    u1, e1 = draws([2, 3], 1)
    u2, e2 = draws([4, 1, 3], 2)
    assert torch.equal(u1[2:5], u2[5:8]) and torch.equal(e1[1], e2[2])
    assert not torch.equal(u1[:2], draws([2, 3], 1)[0][:2])  # unseeded rows differ run to run
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    draw_noise([0, 3], 16, {0: gen}, "cpu")  # no drafts: the generator is left alone, as in vLLM
    assert torch.equal(gen.get_state(), state)
    draw_noise([0, 3], 16, {0: gen}, "cpu", bonus_rows=True)  # unless the verifier samples its bonus
    assert not torch.equal(gen.get_state(), state)
    assert (u1 >= 0).all() and (u1 < 1).all() and (e1 > 0).all()


def test_sample_drafts_argmax_and_sample():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 10)
    ids, q = sample_drafts(logits, "argmax", temperature=torch.tensor([1.0, 1.0]))
    assert q is None and torch.equal(ids, logits.argmax(-1))
    ids, q = sample_drafts(logits, "sample", temperature=torch.tensor([0.0, 1.0]), top_k=torch.tensor([10, 2]))
    assert torch.equal(ids[0], logits[0].argmax(-1))
    assert torch.allclose(q.sum(-1), torch.ones(2, 3))
    assert ((q[1] > 0).sum(-1) == 2).all()  # top-k 2 filters q like p
    assert (q[1].gather(-1, ids[1][:, None]) > 0).all()  # drafts drawn from q's support
    with pytest.raises(ValueError, match="draft_sample must be one of"):
        sample_drafts(logits, "nucleus", temperature=None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_probs=torch.ones(3, 4)), "target_probs must have 4 rows"),
    (dict(draft_probs=torch.ones(2, 5)), r"draft_probs must be \[3, 4\]"),
    (dict(is_greedy=torch.tensor([False])), "uniforms/exp_noise are required"),
    (dict(cu_num_draft_tokens=torch.tensor([1, 2], dtype=torch.int32), target_probs=torch.ones(5, 4)), "must end at len"),
    (dict(max_spec_len=2), r"counts <= max_spec_len \(2\)"),
    (dict(impl="fast"), "impl must be one of"),
])
def test_bad_input_raises_value_error_naming_the_field(kwargs, match):
    args = dict(draft_token_ids=torch.tensor([0, 1, 2]), cu_num_draft_tokens=torch.tensor([3], dtype=torch.int32),
                target_probs=torch.ones(4, 4) / 4, max_spec_len=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rejection_sample(**args)
