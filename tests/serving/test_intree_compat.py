"""Our z-lab checkpoints run in vLLM 0.32's in-tree DFlash, and it drafts the
same tokens as our reference loop.

A random tiny Qwen3 target (HF format) and our random draft (z-lab format,
float32) are served by the in-tree DFlash on CPU in a subprocess (so no
plugin patch applied elsewhere in the test session can leak in;
VLLM_DFLASH_IMPL=vllm keeps the plugin's own DFlash out). The subprocess
wraps the in-tree drafter's `propose()` (VLLM_ENABLE_V1_MULTIPROCESSING=0
keeps the runner in-process) and records each step's draft tokens. With one
request at a time, vLLM's k-th propose call drafts the same block as our k-th
round, so the draft blocks must be identical, token for token.

The draft's k_norm weights are tied across layers: vLLM's CPU `rms_norm` op
ignores the per-layer weight rows that the in-tree
`precompute_and_store_context_kv` passes for context K (it uses layer 0's
k_norm for every layer; `test_vllm_cpu_grouped_rms_norm_uses_first_row`
pins this), so untied weights would measure that vLLM bug, not our semantics.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 8
NEW_TOKENS = 48
NUM_PROMPTS = 3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve_in_tree(
    target_dir: str, draft_dir: str, prompts: list[list[int]], out_path: str
) -> None:
    """Subprocess body: in-tree DFlash, one request at a time, then a batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from engines import vllm_engine
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from vllm_dflash.patches import model_runner_of

    with vllm_engine(
        model=target_dir,
        speculative_config={
            "method": "dflash",
            "model": draft_dir,
            "num_speculative_tokens": BLOCK_SIZE - 1,
        },
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
    ) as llm:
        runner = model_runner_of(llm)
        drafter = runner.drafter
        steps: list[list[int]] = []
        propose = drafter.propose

        def recording_propose(*args, **kwargs):
            draft_ids = propose(*args, **kwargs)
            steps.append(draft_ids[0].tolist())
            return draft_ids

        drafter.propose = recording_propose
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        single = []
        for prompt in prompts:
            steps.clear()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            single.append({"output": list(out[0].outputs[0].token_ids), "drafts": list(steps)})
        batch = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        result = {
            "drafter_class": type(drafter) is DFlashProposer,
            "draft_model_class": type(drafter.model) is DFlashQwen3ForCausalLM,
            "single": single,
            "batch": [list(o.outputs[0].token_ids) for o in batch],
        }
    with open(out_path, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(target, draft, prompts, in-tree results) for one in-tree engine run."""
    from limits import HANG_GUARD_S  # imported here: this file also runs as a script
    from helpers import correlate_pair, random_draft, random_prompts, save_pair, tiny_target

    root = tmp_path_factory.mktemp("intree")
    target = tiny_target("qwen3")
    # Layer 3 is the target's last layer: checks vLLM's capture is pre-norm like ours.
    draft = random_draft(
        target, num_layers=2, block_size=BLOCK_SIZE, target_layer_ids=[0, 2, 3], seed=2
    )
    # Some drafts get accepted (up to tau 7 here), so rounds after multi-token
    # acceptance (longer new context, cropped caches) are compared too.
    correlate_pair(target, draft, scale=64.0)
    with torch.no_grad():
        for layer in draft.layers[1:]:
            layer.self_attn.k_norm.weight.copy_(draft.layers[0].self_attn.k_norm.weight)
    target_dir, draft_dir = save_pair(target, draft, root)
    prompts = random_prompts(NUM_PROMPTS, target.config.vocab_size, min_len=6, max_len=30, seed=11)
    out_path = str(root / "intree.json")
    env = dict(
        os.environ,
        VLLM_DFLASH_IMPL="vllm",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    )
    args = [sys.executable, __file__, target_dir, draft_dir, json.dumps(prompts), out_path]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    if proc.returncode != 0:
        pytest.fail(f"in-tree DFlash run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    with open(out_path) as f:
        return target, draft, prompts, json.load(f)


def test_in_tree_classes_served(served):
    *_, result = served
    assert result["drafter_class"], "the drafter was not vLLM's in-tree DFlashProposer"
    assert result["draft_model_class"], (
        "the draft model was not vLLM's in-tree DFlashQwen3ForCausalLM"
    )


def test_in_tree_greedy_equals_target_greedy(served):
    from vllm_dflash.reference import target_greedy_generate

    target, _, prompts, result = served
    for i, prompt in enumerate(prompts):
        want = target_greedy_generate(target, torch.tensor([prompt]), NEW_TOKENS)
        assert result["single"][i]["output"] == want, f"prompt {i}"
        assert result["batch"][i] == want, f"prompt {i} (batched)"


def test_in_tree_drafts_equal_reference_drafts(served):
    from vllm_dflash.reference import spec_generate

    target, draft, prompts, result = served
    accepted_rounds = 0
    for i, prompt in enumerate(prompts):
        ref = spec_generate(target, draft, torch.tensor([prompt]), NEW_TOKENS)
        vllm_steps = result["single"][i]["drafts"]
        assert ref.output_ids == result["single"][i]["output"]
        # vLLM also drafts after the final verification (unused): at most one extra step.
        assert len(vllm_steps) - len(ref.draft_tokens_per_step) in (0, 1), f"prompt {i}"
        for step, (ours, theirs) in enumerate(
            zip(ref.draft_tokens_per_step, vllm_steps, strict=False)
        ):
            assert ours == theirs, f"prompt {i}, round {step}: reference {ours} != in-tree {theirs}"
        accepted_rounds += sum(tau > 1 for tau in ref.acceptance_lengths)
    # Rounds after partial acceptance (multi-token new context) were compared too.
    assert accepted_rounds > 0


def test_vllm_cpu_grouped_rms_norm_uses_first_row():
    """Pins the vLLM CPU behaviour that the k_norm tying above works around.

    The in-tree DFlash normalises context K of all layers in one call with
    per-layer weight rows [L, head_dim]; the CPU op applies row 0 everywhere.
    If this starts failing, vLLM fixed it and the tying can go.
    """
    import vllm._custom_ops as ops

    x = torch.randn(2, 5, 2, 32)
    w = torch.rand(2, 32) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * w[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, normed * w[:, None, None, :], atol=1e-3)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(REPO, "tests"))  # engines, as conftest.py does for the tests
    _serve_in_tree(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4])
