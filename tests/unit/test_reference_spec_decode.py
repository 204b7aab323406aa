"""Reference speculative loop: greedy output == the target's greedy output,
acceptance bookkeeping, stop tokens, and the sampling rule's distribution."""

import pytest
import torch
from helpers import correlate_pair, random_draft, random_prompts, tiny_target

from vllm_dflash.reference import spec_decode, spec_generate, target_greedy_generate


NEW_TOKENS = 40


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request):
    target = tiny_target(request.param)
    draft = random_draft(target, num_layers=2, block_size=16, target_layer_ids=[0, 2, 3])
    correlate_pair(target, draft)  # random drafts then get accepted now and then
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 256, seed=3)


def _check_bookkeeping(result, block_size, max_new_tokens):
    assert len(result.output_ids) <= max_new_tokens
    assert 1 + sum(result.acceptance_lengths) == len(result.output_ids)
    assert all(1 <= tau <= block_size for tau in result.acceptance_lengths)
    assert len(result.draft_tokens_per_step) == len(result.acceptance_lengths)
    assert all(len(step) == block_size - 1 for step in result.draft_tokens_per_step)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_greedy_equals_target_greedy(pair, prompts, block_size):
    target, draft = pair
    taus = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        want = target_greedy_generate(target, ids, NEW_TOKENS)
        got = spec_generate(target, draft, ids, NEW_TOKENS, block_size=block_size)
        assert got.output_ids == want
        assert len(got.output_ids) == NEW_TOKENS
        _check_bookkeeping(got, block_size, NEW_TOKENS)
        taus += got.acceptance_lengths
    # The correlated pair accepts some drafts, so the multi-token paths ran.
    assert max(taus) > 1


def test_stop_token_ends_output(pair, prompts):
    target, draft = pair
    ids = torch.tensor([prompts[0]])
    full = target_greedy_generate(target, ids, NEW_TOKENS)
    stop_at = next(i for i in range(5, NEW_TOKENS) if full[i] not in full[:i])  # first occurrence
    stop = full[stop_at]
    want = full[: stop_at + 1]
    assert target_greedy_generate(target, ids, NEW_TOKENS, stop_token_ids=[stop]) == want
    for block_size in (4, 16):
        got = spec_generate(
            target, draft, ids, NEW_TOKENS, block_size=block_size, stop_token_ids=[stop]
        )
        assert got.output_ids == want
        _check_bookkeeping(got, block_size, NEW_TOKENS)


def test_first_token_stop_and_single_token(pair, prompts):
    target, draft = pair
    ids = torch.tensor([prompts[1]])
    first = target_greedy_generate(target, ids, 1)
    for kwargs in ({"max_new_tokens": 1}, {"max_new_tokens": 10, "stop_token_ids": first}):
        got = spec_generate(target, draft, ids, **kwargs)
        assert got.output_ids == first
        assert got.acceptance_lengths == [] and got.draft_tokens_per_step == []


def test_oracle_drafts_are_accepted_exactly(pair, prompts, monkeypatch):
    """Drafts that are right for their first k tokens yield acceptance k + 1.

    The real draft still runs (so its context cache is exercised); its tokens
    are replaced by the target's greedy continuation, corrupted after k.
    """
    target, draft = pair
    B = 8
    ids = torch.tensor([prompts[2]])
    truth = target_greedy_generate(target, ids, NEW_TOKENS + B)
    plan = iter([7, 0, 3, 7, 7, 1, 5, 2, 6, 0, 7, 4] * 4)
    expected = []
    real_draft_block = spec_decode.draft_block

    def oracle(draft, target, last_token, new_context, start, block_size, kv_cache, *args):
        assert kv_cache.length == start - new_context.shape[1]  # context bookkeeping
        real_draft_block(draft, target, last_token, new_context, start, block_size, kv_cache, *args)
        assert kv_cache.length == start
        done = start - ids.shape[1] + 1  # tokens generated so far
        assert truth[done - 1] == last_token
        k = next(plan)
        right = truth[done : done + block_size - 1]
        wrong = [(t + 1) % 255 for t in right]
        expected.append(min(k + 1, NEW_TOKENS - done))
        return right[:k] + wrong[k:]

    monkeypatch.setattr(spec_decode, "draft_block", oracle)
    got = spec_generate(target, draft, ids, NEW_TOKENS, block_size=B)
    assert got.output_ids == truth[:NEW_TOKENS]
    assert got.acceptance_lengths == expected
    _check_bookkeeping(got, B, NEW_TOKENS)


def test_bad_arguments_raise(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*\[1, n\]"):
        spec_generate(target, draft, torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        spec_generate(target, draft, torch.zeros(1, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="block_size=1"):
        spec_generate(target, draft, torch.zeros(1, 3, dtype=torch.long), 4, block_size=1)
    with pytest.raises(ValueError, match="temperature=-1"):
        spec_generate(target, draft, torch.zeros(1, 3, dtype=torch.long), 4, temperature=-1)


# --- sampling (T > 0) -----------------------------------------------------------

# Chi-square goodness-of-fit at significance 1e-3: a correct sampler fails a
# test with probability 0.001; with these counts a sampler that ignores the
# accept/reject rule (e.g. always keeps the draft) fails with probability ~1.
ALPHA = 1e-3


def _chi2_passes(counts, probs):
    """Pool cells with expected count < 5, then compare to the critical value."""
    from scipy.stats import chi2

    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat < chi2.ppf(1 - ALPHA, len(counts) - 1)


def test_point_mass_rule_reproduces_target_distribution():
    """verify_sampled's first emitted token ~ p0 and, after accepting x0, the next ~ p1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    T = 0.8
    probs = torch.softmax(logits / T, -1)
    drafts = [int(probs[0].argmax()), int(probs[1].argmin())]  # one likely, one unlikely draft
    n = 8000
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(n):
        out = spec_decode.verify_sampled(drafts, logits, T, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert _chi2_passes(first, probs[0])
    assert _chi2_passes(second, probs[1])
    # The unlikely draft is rarely kept: its acceptance rate is p1(x1).
    assert second[drafts[1]] / second.sum() == pytest.approx(float(probs[1, drafts[1]]), abs=0.02)


def test_sampled_generation_matches_target_distribution():
    """End to end at T = 1: the 2nd token's law equals the target's exact marginal."""
    target = tiny_target("qwen3", vocab_size=16, seed=4, initializer_range=0.3)
    draft = random_draft(target, num_layers=1, block_size=4, target_layer_ids=[1, 3])
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1], -1)
        extended = torch.cat([prompt.repeat(16, 1), torch.arange(16)[:, None]], 1)
        p2_given_1 = torch.softmax(target(extended).logits[:, -1], -1)
    p2 = p1 @ p2_given_1
    gen = torch.Generator().manual_seed(0)
    n = 600
    counts = torch.zeros(16)
    accepted = 0
    for _ in range(n):
        res = spec_generate(target, draft, prompt, 2, temperature=1.0, generator=gen)
        counts[res.output_ids[1]] += 1
        accepted += (
            res.output_ids[1] == res.draft_tokens_per_step[0][0]
        )  # residual excludes the draft
    assert _chi2_passes(counts, p2)
    assert accepted > 0  # some drafts went through the accept branch


def test_sampling_is_reproducible_with_a_generator(pair, prompts):
    target, draft = pair
    ids = torch.tensor([prompts[0]])
    runs = [
        spec_generate(
            target, draft, ids, 20, temperature=1.0, generator=torch.Generator().manual_seed(s)
        )
        for s in (5, 5, 6)
    ]
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].output_ids != runs[2].output_ids
    for run in runs:
        _check_bookkeeping(run, draft.block_size, 20)
