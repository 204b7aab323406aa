"""`torchrun --nproc-per-node 2 vllm-dflash train` (gloo on CPU): the same loss curve as one
process over the same global batch, resumption at another world size, an export that loads.

Both runs draw the same global batches (a seeded stream of sequence indices) and
the same anchors (drawn per sequence from (seed, step, index)); each rank computes
half of every batch and its loss is normalised by the whole batch's weight, so the
averaged gradient is the one-process gradient. They differ only in the order of
float32 sums (two partial sums and an all-reduce instead of one sum, and other
padding widths), about 1e-7 relative per step, which a few Adam steps amplify to
at most about 1e-5. RTOL = 1e-4 is ten times that and still 100x below the
smallest step-to-step change of the loss (asserted), so dropping, duplicating or
mis-weighting a rank's share of the batch fails it.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import random_prompts, tiny_target
from vllm_dflash.config import default_target_layer_ids, validate_draft_config
from vllm_dflash.reference import load_draft, load_draft_config, target_greedy_generate
from vllm_dflash.training import cli
from vllm_dflash.training.data import load_prompts
from vllm_dflash.training.responses import generate_responses

torch.set_num_threads(1)
RTOL = 1e-4
STEPS = 6
MASK_ID = 95


def common_args(root) -> list[str]:
    return ["--target", str(root / "target"), "--out", str(root / "out"), "--prompts", str(root / "prompts.jsonl"),
            "--num-prompts", "24", "--max-new-tokens", "24", "--max-len", "64", "--num-layers", "1",
            "--block-size", "8", "--mask-token-id", str(MASK_ID), "--blocks-per-seq", "4", "--batch-size", "8",
            "--lr", "3e-3", "--warmup", "0", "--min-lr-ratio", "1", "--autocast", "fp32", "--log-every", "1",
            "--checkpoint-every", "3"]


def run_in_process(args: list[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(args)) == 0


def losses(root, run: str) -> dict[int, float]:
    with open(root / "out" / "runs" / run / "history.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["train"]["loss"] for r in rows if "train" in r and "lr" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    target = tiny_target(vocab_size=96, hidden_size=64, num_layers=4)
    target.save_pretrained(root / "target")
    with open(root / "prompts.jsonl", "w") as f:
        for p in random_prompts(24, MASK_ID, min_len=4, max_len=16, seed=7):
            f.write(json.dumps({"prompt_ids": p}) + "\n")

    def greedy(prompts, settings):   # the target's greedy answers (what vLLM returns; see test_training_e2e)
        return [target_greedy_generate(target, torch.tensor([p]), s["max_tokens"]) for p, s in zip(prompts, settings)]

    generate_responses(str(root / "target"), load_prompts(str(root / "prompts.jsonl")), str(root / "out" / "responses.jsonl"),
                       max_new_tokens=24, max_len=64, generate=greedy)
    args = common_args(root)
    run_in_process(args + ["--steps", str(STEPS), "--run-name", "one"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "vllm_dflash.cli", "train", *args, "--steps", str(STEPS // 2), "--run-name", "two"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    two_losses = losses(root, "two")
    shutil.copytree(root / "out" / "runs" / "two" / "draft", root / "two-process-draft")  # before the resume
    run_in_process(args + ["--steps", str(STEPS), "--run-name", "two"])   # resumes step 3 at world size 1
    return root, target, two, two_losses


def test_two_processes_follow_the_one_process_loss_curve(runs):
    root, _, two, two_losses = runs
    assert "data parallel: 2 processes, global batch 8 sequences" in two.stdout
    one = losses(root, "one")
    assert sorted(one) == list(range(1, STEPS + 1)) and sorted(two_losses) == list(range(1, STEPS // 2 + 1))
    for step, loss in two_losses.items():
        assert loss == pytest.approx(one[step], rel=RTOL), (step, loss, one[step])
    worst = max(abs(loss / one[step] - 1) for step, loss in two_losses.items())
    print(f"1 vs 2 processes: {[(s, one[s], two_losses[s]) for s in sorted(two_losses)]}, largest rel. diff {worst:.1e}")
    smallest_change = min(abs(one[s + 1] - one[s]) / one[s] for s in range(1, STEPS))
    assert smallest_change > 100 * RTOL, one


def test_checkpoint_of_two_processes_resumes_in_one(runs):
    root, _, _, _ = runs
    one, resumed = losses(root, "one"), losses(root, "two")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(STEPS // 2 + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(one[step], rel=RTOL), (step, resumed[step], one[step])


def test_only_rank_zero_writes_and_the_export_loads(runs):
    root, target, two, _ = runs
    run_dir = root / "out" / "runs" / "two"
    assert sorted(os.listdir(run_dir)) == ["checkpoint.pt", "draft", "history.jsonl", "summary.json"]
    assert two.stdout.count("exported ") == 1 and two.stdout.count("done: ") == 1
    validate_draft_config(load_draft_config(str(run_dir / "draft")), target.config)
    draft = load_draft(str(run_dir / "draft"), target_config=target.config)
    assert draft.block_size == 8 and list(draft.target_layer_ids) == default_target_layer_ids(4, 1)


@pytest.mark.vllm
def test_the_two_process_export_serves_in_the_plugin(runs):
    """The 2-process run's own export (before the resume) drafts in vLLM through this plugin,
    and the tokens are the target's greedy ones."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engines import vllm_engine
    from helpers import random_prompts
    from vllm_dflash.patches import model_runner_of

    root, target, _, _ = runs
    prompts = random_prompts(4, MASK_ID, min_len=4, max_len=12, seed=11)
    spec = {"method": "dflash", "model": str(root / "two-process-draft"), "adaptive": False}
    with vllm_engine(model=str(root / "target"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                     enforce_eager=True, max_num_seqs=4, speculative_config=spec) as llm:
        drafter = model_runner_of(llm).drafter
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert f"{type(drafter).__module__}.{type(drafter).__qualname__}" == "vllm_dflash.serving.proposer.DFlashProposer"
    for p, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == target_greedy_generate(target, torch.tensor([p]), 16)
