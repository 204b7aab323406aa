"""T=1 sampling through vLLM with vllm-dflash's DFlash keeps the target's distribution.

Lossless speculative sampling means the tokens a request gets are distributed
exactly as without speculation. Four in-process engines (float32, one at a
time) serve N requests each at temperature 1, every request with its own seed
(disjoint seed ranges per engine, so the samples are independent),
max_tokens=4, in one generate call per engine:

* no speculation (the reference);
* DFlash, k=3, draft_sample="argmax" (point-mass drafts);
* DFlash, k=3, draft_sample="sample" (drafts drawn from the draft's softmax;
  the proposer's q [B, k, V] float32 must reach the verifier, checked too);
* adaptive DFlash (at most k=3, sampled drafts) on the forced "jump"
  schedule: steps without drafting, and requests of one verified batch with
  0, 1, 2 and 3 drafts (checked), so drafts shorter than the drafted block
  are verified with their sliced draft probabilities.

Requests alternate between two prompts: one whose continuation is nearly
deterministic (drafts accepted often, several positions deep) and one whose
continuation is broad (rejections and recovered tokens). Token 1 comes from
the prefill's sampler, tokens 2-4 from the first verification step (accepted
drafts, the recovered token, the bonus token), so the checks cover every draft
position: per DFlash engine, two-sample chi-square homogeneity tests against
the reference on (prompt, token 1, token 2) and on (prompt, token 3) and
(prompt, token 4). Outcomes with a combined count below 10 (expected count 5
per engine) are pooled. A test fails when p < ALPHA = 1e-3 (9 tests: a false
failure rate of at most 0.9%; the engines are seeded, so a given build passes
or fails reproducibly). Power: the statistic is non-central chi-square with
lambda ~ N/2 * sum (p-q)^2 / pbar; each test prints the smallest
sum (p-q)^2 / pbar it detects with 90% power at its degrees of freedom, and
`test_statistic_detects_a_temperature_change` shows the same test rejecting
the reference against N/4 samples of itself at T=0.7.

Pair: the bundled toy target with the bundled trained drafter
(models/toy-draft) when it is there (prompts: two held-out chat prompts
extended with the target's greedy answer to 48 tokens, so that 32 are
prefix-cached), else a tiny random correlated pair (8-token random prompts).
Chunked prefill is off, so every request's first token comes from a one-step
prefill (seeded chunked prefills: tests/serving/test_seeded_chunked_prefill.py
shows they give the very tokens of unchunked ones). With draft_sample="sample"
each request's drafts come from its own seeded generator.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from engines import vllm_engine
from serving_pairs import (
    TINY_VOCAB,
    TOY_TARGET,
    check_spec_metrics,
    delta,
    spec_metrics_from_llm,
    tiny_pair,
    toy_draft_is_bundled,
    toy_pair,
    toy_prompts,
)

N = 2000
K = 3
MAX_TOKENS = 4
ALPHA = 1e-3
MIN_CELL = 10  # combined count; expected count per engine >= 5
# Engine name -> (draft_sample, forced adaptive schedule or None for static k).
ENGINES = {"argmax": ("argmax", None), "sample": ("sample", None), "adaptive-jump": ("sample", "jump")}
MODES = tuple(ENGINES)
POWER_T = 0.7  # the reference at this temperature must be told apart from T=1
TOY_PROMPT_LEN = 48
TOY_PROMPTS = (10, 0)  # toy_prompts() indices: a math prompt (peaked answer), a code prompt (broad)

pytestmark = pytest.mark.vllm


def toy_prompt_ids() -> list[list[int]]:
    """Chat prompts continued with the toy target's greedy answer up to TOY_PROMPT_LEN tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    model = AutoModelForCausalLM.from_pretrained(TOY_TARGET, dtype=torch.float32).eval()
    texts = toy_prompts(max(TOY_PROMPTS) + 1)
    prompts = []
    for i in TOY_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": texts[i]}], add_generation_prompt=True,
                                            tokenize=True)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=TOY_PROMPT_LEN - len(ids))
        prompts.append(out[0].tolist())
    return prompts


def tiny_prompt_ids() -> list[list[int]]:
    from helpers import random_prompts

    return random_prompts(2, TINY_VOCAB, min_len=8, max_len=8, seed=11)


class DraftProbsProbe:
    """Records, per verification step with drafts, whether the verifier got draft
    probabilities and what the proposer handed over (shape, dtype, row-sum error),
    and the set of per-request draft lengths verified."""

    def __init__(self, runner):
        self.verifier_calls: list[bool] = []
        self.verified_lengths: list[list[int]] = []
        self.handed: list[tuple[tuple[int, ...], str, float]] = []
        sampler, drafter = runner.rejection_sampler, runner.drafter
        original_forward, original_take = sampler.forward, drafter.take_last_draft_probs

        def forward(metadata, draft_probs, logits, sampling_metadata):
            if sum(metadata.num_draft_tokens) > 0:  # prefill-only steps verify nothing
                self.verifier_calls.append(draft_probs is not None)
                self.verified_lengths.append(list(metadata.num_draft_tokens))
            return original_forward(metadata, draft_probs, logits, sampling_metadata)

        def take_last_draft_probs():
            probs = original_take()
            if probs is not None:
                err = float((probs.sum(-1) - 1).abs().max())
                self.handed.append((tuple(probs.shape), str(probs.dtype), err))
            return probs

        sampler.forward, drafter.take_last_draft_probs = forward, take_last_draft_probs


def run_engine(target_dir, draft_dir, mode, prompts, seed_offset=0, extra_runs=()):
    """mode: None (no speculation) or a key of ENGINES."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dflash.patches import model_runner_of

    kwargs = dict(
        model=target_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=128,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
        block_size=32,
        enforce_eager=True,
        disable_log_stats=False,
    )
    schedule = None
    if mode is not None:
        draft_sample, schedule = ENGINES[mode]
        kwargs["speculative_config"] = {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K,
                                        "draft_sample": draft_sample, "adaptive": schedule is not None}
    from vllm_dflash import envs

    env = {envs.ADAPTIVE_SCHEDULE_ENV: schedule} if schedule else None  # read when the proposer is built
    result = {}
    with vllm_engine(env=env, **kwargs) as llm:
        runner = model_runner_of(llm)
        probe = DraftProbsProbe(runner) if mode is not None else None
        before = spec_metrics_from_llm(llm) if mode is not None else None

        def sample(temperature, offset, n=N):
            params = [SamplingParams(temperature=temperature, seed=offset + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                      for i in range(n)]
            inputs = [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(n)]
            outs = llm.generate(inputs, params, use_tqdm=False)
            result.setdefault("cached_tokens", []).append(sum(o.num_cached_tokens or 0 for o in outs) / len(outs))
            return [(i % len(prompts), *o.outputs[0].token_ids) for i, o in enumerate(outs)]

        start = time.perf_counter()
        result["tokens"] = sample(1.0, seed_offset)
        for name, temperature, offset, n in extra_runs:
            result[name] = sample(temperature, offset, n)
        print(f"\n[engine draft_sample={mode}] generate: {time.perf_counter() - start:.1f} s, "
              f"prefix-cached prompt tokens per request {result['cached_tokens']}")
        if mode is not None:
            result["metrics"] = delta(spec_metrics_from_llm(llm), before)
            result["probe"] = probe
            result["verified_lengths"] = probe.verified_lengths
            result["draft_sample_method"] = llm.llm_engine.vllm_config.speculative_config.draft_sample_method
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sampling_e2e"))
    use_toy = toy_draft_is_bundled()
    target_dir, draft_dir = toy_pair(root) if use_toy else tiny_pair(root)
    prompts = toy_prompt_ids() if use_toy else tiny_prompt_ids()
    out = {"pair": "toy" if use_toy else "tiny"}
    out[None] = run_engine(target_dir, draft_dir, None, prompts, extra_runs=[("cooler", POWER_T, 2 * N, N // 4)])
    for i, mode in enumerate(MODES):
        out[mode] = run_engine(target_dir, draft_dir, mode, prompts, seed_offset=(i + 1) * 10 * N)
    return out


def two_sample_chi2(a: list, b: list) -> tuple[float, int, float]:
    """Chi-square homogeneity test of two samples of hashable outcomes: (stat, dof, p)."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    kept = sorted((c for c in set(ca) | set(cb) if ca[c] + cb[c] >= MIN_CELL), key=lambda c: -(ca[c] + cb[c]))
    rows = [[ca[c] for c in kept], [cb[c] for c in kept]]
    other = (len(a) - sum(rows[0]), len(b) - sum(rows[1]))
    if sum(other) >= MIN_CELL:
        rows[0].append(other[0])
        rows[1].append(other[1])
    elif rows[0]:  # too few pooled outcomes for a cell of their own: add them to the rarest kept one
        rows[0][-1] += other[0]
        rows[1][-1] += other[1]
    if len(rows[0]) < 2:
        return 0.0, 0, 1.0
    stat, p, dof, _ = chi2_contingency(rows, correction=False)
    return float(stat), int(dof), float(p)


def detectable_divergence(n: int, dof: int, power: float = 0.9) -> float:
    """Smallest sum (p-q)^2 / pbar the test detects with `power` at ALPHA (two samples of n)."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    critical = chi2.ppf(1 - ALPHA, dof)
    lam = brentq(lambda lam: ncx2.sf(critical, dof, lam) - power, 1e-6, 1e4)
    return lam / (n / 2)


# Outcome of one request (prompt index, token 1, ..., token 4) -> what is compared.
STATS = {
    "tokens 1-2 (joint)": lambda t: t[:3],
    "token 3": lambda t: (t[0], t[3]),
    "token 4": lambda t: (t[0], t[4]),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stat_name", list(STATS))
def test_first_tokens_follow_the_target_distribution(runs, mode, stat_name):
    pick = STATS[stat_name]
    reference = [pick(t) for t in runs[None]["tokens"]]
    dflash = [pick(t) for t in runs[mode]["tokens"]]
    stat, dof, p = two_sample_chi2(reference, dflash)
    m = runs[mode]["metrics"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / max(m["vllm:spec_decode_num_drafts"], 1)
    print(f"\n[{runs['pair']} pair, draft_sample={mode}] {stat_name}: chi2={stat:.1f} dof={dof} p={p:.3g}; "
          f"90%-power divergence {detectable_divergence(N, max(dof, 1)):.4f}; tau={tau:.3f} "
          f"per-pos {m['vllm:spec_decode_num_accepted_tokens_per_pos']}")
    assert dof >= 1, "the outcome has a single category: nothing is being tested"
    assert p >= ALPHA, f"{stat_name} with draft_sample={mode} differs from no speculation: chi2={stat:.1f}, p={p:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_drafts_were_verified_with_the_right_draft_probabilities(runs, mode):
    result = runs[mode]
    adaptive = ENGINES[mode][1] is not None
    tau = check_spec_metrics(result["metrics"], K, fixed_length=not adaptive)
    per_pos = result["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[0] > 0, "no draft accepted: the accept path is untested"
    probe = result["probe"]
    assert probe.verifier_calls, "the verifier never ran"
    if adaptive:  # the forced schedule mixed draft lengths (0 and K included) within verified batches
        mixed = [n for n in result["verified_lengths"] if set(n) == set(range(K + 1))]
        assert mixed, [sorted(set(n)) for n in result["verified_lengths"]]
    if mode == "argmax":
        assert result["draft_sample_method"] == "greedy"
        assert not any(probe.verifier_calls) and not probe.handed
    else:
        assert result["draft_sample_method"] == "probabilistic"
        assert all(probe.verifier_calls), "a verification step got no draft probabilities"
        assert probe.handed
        for shape, dtype, err in probe.handed:
            width_ok = 1 <= shape[1] <= K if adaptive else shape[1] == K  # adaptive: the drafted block q
            assert len(shape) == 3 and width_ok and dtype == "torch.float32" and err < 1e-4
    print(f"\n[{runs['pair']} pair] draft_sample={mode}: mean acceptance length {tau:.3f} at T=1, per-pos {per_pos}")


def test_statistic_detects_a_temperature_change(runs):
    """Power in practice: the reference at T=1 against itself at POWER_T must be rejected."""
    reference = [t[:3] for t in runs[None]["tokens"]]
    cooler = [t[:3] for t in runs[None]["cooler"]]
    stat, dof, p = two_sample_chi2(reference, cooler)
    print(f"\nT=1 vs T={POWER_T}, (prompt, tokens 1-2): chi2={stat:.1f} dof={dof} p={p:.3g}")
    assert p < ALPHA
