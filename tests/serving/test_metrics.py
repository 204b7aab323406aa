"""vLLM's spec-decode metrics count vllm-dflash's DFlash steps (LLM.get_metrics()).

Acceptance length and per-position acceptance reach users through vLLM's own
counters (the scheduler fills SpecDecodingStats from the verifier's output):
vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and
_num_accepted_tokens_per_pos. One engine: a tiny random float32 target with a
correlated random draft (drafts get accepted), k=4 every step (`adaptive:
false`), greedy, in-process. `vllm serve`'s /metrics is checked in
test_serve_openai.py, adaptive speculation's metrics in
e2e/test_adaptive_metrics.py.
"""

from __future__ import annotations

import pytest
from engines import vllm_engine
from serving_pairs import PER_POS, TINY_VOCAB, check_spec_metrics, delta, spec_metrics_from_llm, tiny_pair

K = 4
NUM_PROMPTS = 12
MAX_TOKENS = 40

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target_dir, draft_dir = tiny_pair(str(tmp_path_factory.mktemp("metrics")))
    with vllm_engine(
        model=target_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        disable_log_stats=False,  # LLM turns stats off by default: no metrics without this
        speculative_config={"method": "dflash", "model": draft_dir, "num_speculative_tokens": K, "adaptive": False},
    ) as engine:
        yield engine


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_spec_decode_counters_describe_the_run(llm):
    from helpers import random_prompts

    prompts = random_prompts(NUM_PROMPTS, TINY_VOCAB, min_len=4, max_len=30, seed=5)
    before = spec_metrics_from_llm(llm)
    outputs = generate(llm, prompts, MAX_TOKENS)
    m = delta(spec_metrics_from_llm(llm), before)
    tau = check_spec_metrics(m, K)
    print(f"\nspec metrics: {m}, mean acceptance length {tau:.3f}")
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0, "the correlated pair gets drafts accepted: the counters must see them"
    # Every token after the prefill's comes out of a verification step: one
    # bonus/recovered token per draft plus the accepted ones, minus what
    # max_tokens cut from each request's last step (at most K).
    produced = sum(len(o) for o in outputs) - len(prompts)
    assert all(len(o) == MAX_TOKENS for o in outputs)
    assert drafts <= produced <= drafts + accepted
    assert drafts + accepted - produced <= K * len(prompts)


def test_counters_accumulate_across_calls(llm):
    """A second identical batch adds exactly the same counts (greedy, deterministic)."""
    from helpers import random_prompts

    prompts = random_prompts(4, TINY_VOCAB, min_len=6, max_len=12, seed=6)
    first_before = spec_metrics_from_llm(llm)
    generate(llm, prompts, 24)
    middle = spec_metrics_from_llm(llm)
    generate(llm, prompts, 24)
    first, second = delta(middle, first_before), delta(spec_metrics_from_llm(llm), middle)
    assert first == second, (first, second)
    assert len(first[PER_POS]) == K and first["vllm:spec_decode_num_drafts"] > 0
