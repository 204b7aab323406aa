"""Greedy decoding in bfloat16: vllm-dflash's DFlash against no speculation.

In bf16 exact token equality cannot be demanded: the verifier scores k+1
tokens per request in one target pass, decoding without speculation scores one,
and the two matmul shapes round differently, so where the target's two best
tokens are almost tied the argmax may flip. Every such flip must be explainable
that way: at a request's first divergent position the non-speculative run's
top-2 logprobs (requested with logprobs=2) must differ by less than EPS and the
speculative run's token must be the other of those two. Any other divergence
fails. (After the first divergence the two runs decode different texts, so
nothing later is compared.)

EPS = 0.25 nats. Logprob gaps equal logit gaps; vLLM computes the LM head in
the model dtype, so each logit is rounded to bf16 (8 significant bits: spacing
0.0625-0.125 for logits of magnitude 8-32, the toy target's range) on top of
the bf16 rounding of every activation before it. The gap of two logits can
therefore move by about two bf16 spacings between batch shapes: 0.25. The same
bound is checked on the target itself: `test_eps_covers_the_shape_noise_of_the_target`
re-scores the non-speculative outputs as prompts (prefill shapes) and measures
how far the top-2 gaps move against decode time.

Pair: the bundled toy target (bf16 checkpoint) with the bundled trained
drafter (models/toy-draft) when it is there, else a random draft for it;
32 held-out prompts (code, math, prose), 64 tokens each, k=7.
"""

from __future__ import annotations

import pytest
from engines import vllm_engine
from serving_pairs import TOY_TARGET, check_spec_metrics, delta, spec_metrics_from_llm, toy_pair, toy_prompts

EPS = 0.25
K = 7
NUM_PROMPTS = 32
MAX_TOKENS = 64

pytestmark = pytest.mark.vllm


def run_engine(target_dir: str, draft_dir: str | None, work) -> dict:
    """Build one engine, run work(llm) -> dict, shut the engine down (one engine alive at a time)."""
    kwargs = dict(
        model=target_dir,
        dtype="bfloat16",
        seed=0,
        max_model_len=512,
        max_num_seqs=32,
        enforce_eager=True,
        disable_log_stats=False,
    )
    if draft_dir is not None:
        kwargs["speculative_config"] = {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K,
                                        "adaptive": False}  # every step verifies k + 1 tokens in bf16
    with vllm_engine(**kwargs) as llm:
        return work(llm)


def top2(logprobs: dict) -> list[tuple[int, float]]:
    """The two best (token, logprob) pairs of one position's vLLM logprobs dict."""
    ranked = sorted(((tok, lp.logprob) for tok, lp in logprobs.items()), key=lambda t: -t[1])
    return ranked[:2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    target_dir, draft_dir = toy_pair(str(tmp_path_factory.mktemp("bf16")))
    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
        for p in toy_prompts(NUM_PROMPTS)
    ]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    out = {"prompts": prompts}

    def plain(llm):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        results = llm.generate(inputs, params, use_tqdm=False)
        tokens = [list(r.outputs[0].token_ids) for r in results]
        # The same texts scored as prompts: prefill shapes instead of decode shapes.
        rescore = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
        scored = llm.generate([TokensPrompt(prompt_token_ids=p + o) for p, o in zip(prompts, tokens)],
                              rescore, use_tqdm=False)
        return {
            "plain": tokens,
            "plain_logprobs": [[top2(lp) for lp in r.outputs[0].logprobs] for r in results],
            "prefill_logprobs": [[top2(lp) for lp in r.prompt_logprobs[len(p):]] for r, p in zip(scored, prompts)],
        }

    def dflash(llm):
        before = spec_metrics_from_llm(llm)
        results = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        return {"dflash": [list(r.outputs[0].token_ids) for r in results],
                "metrics": delta(spec_metrics_from_llm(llm), before)}

    out.update(run_engine(target_dir, None, plain))
    out.update(run_engine(target_dir, draft_dir, dflash))
    return out


def test_every_divergence_is_a_near_tie(runs):
    tau = check_spec_metrics(runs["metrics"], K)
    equal, ties, failures = 0, [], []
    for i, (plain, dflash) in enumerate(zip(runs["plain"], runs["dflash"])):
        assert len(plain) == len(dflash) == MAX_TOKENS
        j = next((j for j, (a, b) in enumerate(zip(plain, dflash)) if a != b), None)
        if j is None:
            equal += 1
            continue
        (best, lp1), (second, lp2) = runs["plain_logprobs"][i][j]
        gap = lp1 - lp2
        explained = gap < EPS and {plain[j], dflash[j]} == {best, second}
        (ties if explained else failures).append((i, j, plain[j], dflash[j], round(gap, 4)))
    print(f"\nbf16 greedy, {len(runs['plain'])} prompts: {equal} identical, {len(ties)} near-tie divergences "
          f"{ties}; tau={tau:.3f} per-pos {runs['metrics']['vllm:spec_decode_num_accepted_tokens_per_pos']}")
    assert not failures, f"divergences not explained by a top-2 gap < {EPS} (prompt, pos, plain, dflash, gap): {failures}"
    assert equal >= len(runs["plain"]) // 2, "most prompts must decode identically"


def test_eps_covers_the_shape_noise_of_the_target(runs):
    """The top-2 gap of the target itself, decode shapes vs prefill shapes, moves by less than EPS."""
    shifts = []
    for decode, prefill in zip(runs["plain_logprobs"], runs["prefill_logprobs"]):
        for d, p in zip(decode, prefill):
            if d[0][0] == p[0][0] and d[1][0] == p[1][0]:  # same top-2 tokens: compare the gaps
                shifts.append(abs((d[0][1] - d[1][1]) - (p[0][1] - p[1][1])))
    shifts.sort()
    print(f"\ntop-2 gap shift decode vs prefill over {len(shifts)} positions: "
          f"median {shifts[len(shifts) // 2]:.4f}, 99th pct {shifts[int(len(shifts) * 0.99)]:.4f}, max {shifts[-1]:.4f}")
    assert len(shifts) >= len(runs["plain"]) * MAX_TOKENS // 2
    assert shifts[-1] < EPS
