"""vllm-dflash's verifier inside vLLM's engine (CPU, float32).

A tiny random Qwen3 target and a random DFlash draft correlated with it (so
drafts get accepted), served by vllm-dflash's proposer with our
DFlashRejectionSampler in place of vLLM's. Two engines: argmax drafting (k=7)
and vLLM's draft_sample_method="probabilistic" (k=4, draft probabilities go to
the verifier). Oracle: the target's own greedy decoding in transformers.

* greedy requests equal the oracle token for token, alone and in batches
  mixed with sampled requests;
* T=1 requests with top_k=1, or with min_p=1, must also equal the oracle:
  exact evidence that the filters reach the draft positions (vLLM 0.32's own
  rejection sampler ignores min-p there and would fail the min-p case);
* seeded T=1 requests return valid tokens, and with argmax drafts the same
  seed reproduces the same output (probabilistic drafts are drawn without the
  request's seed by vLLM, so only validity is checked there).
"""

from __future__ import annotations

import pytest
import torch
from engines import vllm_engine

VOCAB = 256
BLOCK_SIZE = 8
NUM_PROMPTS = 6
MAX_TOKENS = 24

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from helpers import correlate_pair, random_draft, random_prompts, save_pair, tiny_target

    target = tiny_target(vocab_size=VOCAB, seed=0)
    draft = random_draft(target, num_layers=2, block_size=BLOCK_SIZE, seed=1)
    correlate_pair(target, draft)
    target_dir, draft_dir = save_pair(target, draft, str(tmp_path_factory.mktemp("verifier_vllm")))
    prompts = random_prompts(NUM_PROMPTS, VOCAB, min_len=4, max_len=30, seed=3)
    with torch.no_grad():  # non-speculative greedy decoding of the target itself
        oracle, oracle_logprobs = [], []
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(MAX_TOKENS):
                ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
            oracle.append(ids[0, len(p):].tolist())
            logprobs = target(ids).logits[0, len(p) - 1:-1].log_softmax(-1)
            oracle_logprobs.append(logprobs.gather(-1, ids[0, len(p):, None])[:, 0].tolist())
    return target_dir, draft_dir, prompts, oracle, oracle_logprobs


class VerifierCalls:
    """Wraps the sampler module's rejection_sample: what our verifier saw and emitted."""

    def __init__(self, monkeypatch):
        from vllm_dflash.verifier import sampler

        self.calls: list[dict] = []
        original = sampler.rejection_sample

        def record(*args, **kwargs):
            out = original(*args, **kwargs)
            self.calls.append(dict(sampled=args[5] is not None, draft_probs=args[3] is not None,
                                   emitted=(out != -1).sum(1).tolist()))
            return out

        monkeypatch.setattr(sampler, "rejection_sample", record)


def run_engine(target_dir, draft_dir, prompts, k, draft_sample_method):
    """Four workloads on one engine; returns their outputs and what the verifier saw."""
    from vllm_dflash.patches import model_runner_of
    from vllm_dflash.verifier.sampler import DFlashRejectionSampler

    with vllm_engine(model=target_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=256,
                           max_num_seqs=8, enforce_eager=True,
                           speculative_config={"method": "dflash", "model": draft_dir, "num_speculative_tokens": k,
                                               "draft_sample_method": draft_sample_method,
                                               # every step verifies k drafts: the verifier's paths are the subject
                                               # here (adaptive lengths: tests/serving/test_sampling_e2e.py)
                                               "adaptive": False}) as llm:
        result = _workloads(llm, model_runner_of(llm), prompts)
    assert result["sampler"] is DFlashRejectionSampler
    return result


def _workloads(llm, runner, prompts) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def generate(params):
        outs = llm.generate(tokens, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def generate_with_logprobs(params):
        outs = llm.generate(tokens, params, use_tqdm=False)
        return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11)
    min_p1 = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    mixed = [greedy, top1, min_p1, seeded[3], seeded[4], seeded[5]][: len(prompts)]
    with pytest.MonkeyPatch.context() as mp:
        calls = VerifierCalls(mp)
        return dict(
            sampler=type(runner.rejection_sampler),
            use_dflash=getattr(runner.rejection_sampler, "use_dflash", False),
            greedy=generate(greedy),
            greedy_logprobs=generate_with_logprobs(
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)),
            mixed=generate(mixed),
            seeded=generate(seeded),
            seeded_again=generate(seeded),
            calls=calls.calls,
        )


@pytest.fixture(scope="module")
def engines(models):
    import vllm_dflash

    vllm_dflash.register()  # no-op when vLLM already loaded it through the entry point
    target_dir, draft_dir, prompts = models[:3]
    return {
        "argmax": run_engine(target_dir, draft_dir, prompts, k=7, draft_sample_method="greedy"),
        "probabilistic": run_engine(target_dir, draft_dir, prompts, k=4, draft_sample_method="probabilistic"),
    }


@pytest.mark.parametrize("mode", ["argmax", "probabilistic"])
def test_our_verifier_served_and_drafts_were_accepted(engines, mode):
    run = engines[mode]
    assert run["use_dflash"]
    assert len(run["calls"]) > 10
    emitted = [n for call in run["calls"] for n in call["emitted"]]
    assert all(n >= 1 for n in emitted)
    assert sum(n >= 3 for n in emitted) >= 5, "multi-token acceptance must be exercised"
    sampled_calls = [c for c in run["calls"] if c["sampled"]]
    assert sampled_calls, "the T=1 workloads must reach the sampled path"
    # draft probabilities reach the verifier only with probabilistic drafting
    assert any(c["draft_probs"] for c in sampled_calls) == (mode == "probabilistic")


@pytest.mark.parametrize("mode", ["argmax", "probabilistic"])
def test_greedy_equals_non_speculative_greedy(models, engines, mode):
    oracle = models[3]
    run = engines[mode]
    assert run["greedy"] == oracle
    assert run["mixed"][0] == oracle[0]  # greedy request batched with sampled ones


@pytest.mark.parametrize("mode", ["argmax", "probabilistic"])
def test_logprobs_of_verified_tokens(models, engines, mode):
    oracle, oracle_logprobs = models[3], models[4]
    for out, tokens, expected in zip(engines[mode]["greedy_logprobs"], oracle, oracle_logprobs):
        assert [t for t, _ in out] == tokens
        assert [lp for _, lp in out] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("mode", ["argmax", "probabilistic"])
def test_top_k_1_and_min_p_1_sampling_is_greedy(models, engines, mode):
    oracle = models[3]
    run = engines[mode]
    assert run["mixed"][1] == oracle[1], "T=1, top_k=1"
    assert run["mixed"][2] == oracle[2], "T=1, min_p=1"


@pytest.mark.parametrize("mode", ["argmax", "probabilistic"])
def test_seeded_sampling_returns_valid_tokens(models, engines, mode):
    oracle = models[3]
    run = engines[mode]
    for out in run["seeded"] + run["seeded_again"] + run["mixed"][3:]:
        assert len(out) == MAX_TOKENS and all(0 <= t < VOCAB for t in out)
    assert run["seeded"] != oracle, "T=1 sampling should not reproduce greedy decoding"
    assert len({tuple(o) for o in run["seeded"]}) == len(run["seeded"])
    if mode == "argmax":
        assert run["seeded_again"] == run["seeded"], "same seeds, same batch, argmax drafts: same output"
