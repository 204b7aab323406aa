"""A short drafter training run on a learnable pattern; exact resume; export -> reload.

Data: after a random prompt, each response counts through 16 tokens with a step
s in {1, 2, 3} drawn per sequence, independent of every token value. From the
anchor token alone the next tokens are ambiguous between three steps, so a drafter
that ignored the context could reach at most 1/3 accuracy at any block position;
above that it must read s from the target features of the context.
"""

import copy
import os
import random

import pytest
import torch
import torch.nn.functional as F

from helpers import random_draft, tiny_target
from vllm_dflash.reference import load_draft
from vllm_dflash.training.data import Sample
from vllm_dflash.training.export import draft_from_checkpoint, export_draft
from vllm_dflash.training.features import build_feature_cache
from vllm_dflash.training.trainer import TrainConfig, Trainer

BLOCK = 8
CYCLE = 16


def counting_samples(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(20, 120) for _ in range(rng.randint(3, 8))]
        step, t, resp = rng.choice([1, 2, 3]), rng.randrange(CYCLE), []
        for _ in range(rng.randint(24, 64)):
            resp.append(4 + t)
            t = (t + step) % CYCLE
        out.append(Sample(prompt + resp, len(prompt)))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = tiny_target(vocab_size=128, hidden_size=64, num_layers=4)
    layer_ids = list(random_draft(target, num_layers=1, block_size=BLOCK).target_layer_ids)
    cache = build_feature_cache(target, counting_samples(200), layer_ids, str(root / "features"), shard_size=64)
    return root, target, cache


def make_trainer(setup, out, **overrides):
    root, target, cache = setup
    draft = random_draft(target, num_layers=1, block_size=BLOCK, seed=3, initializer_range=0.02)
    cfg = TrainConfig(**{"blocks_per_seq": 8, "batch_size": 16, "lr": 3e-3, "max_steps": 300, "log_every": 25,
                         "checkpoint_every": 0, "val_fraction": 0.1, "autocast": "fp32", **overrides})
    return Trainer(draft.train(), target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                   cache, cfg, str(root / out))


@pytest.fixture(scope="module")
def trained(setup):
    trainer = make_trainer(setup, "run")
    before = trainer.validate()
    result = trainer.train()
    return trainer, before, result


def test_training_lowers_loss_and_learns_from_context(trained):
    trainer, before, result = trained
    after = result["val"]
    assert after["loss"] < 0.5 * before["loss"], (before["loss"], after["loss"])
    # Chance is 1/128 per position; context-free drafting is capped at 1/3 (see module doc).
    assert before["acc1"] < 0.05
    assert after["acc1"] > 0.5 and after["acc"][1] > 0.5, after["acc"]
    assert after["tau_est"] > 3.0
    history = (trainer.out_dir + "/history.jsonl")
    assert os.path.exists(history) and os.path.exists(trainer.out_dir + "/checkpoint.pt")


def test_export_reload_gives_identical_logits(trained, setup, tmp_path):
    trainer, _, _ = trained
    _, target, cache = setup
    draft = trainer.draft.cpu().eval()
    export_draft(draft, str(tmp_path / "draft"), "bf16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)
    reloaded = load_draft(str(tmp_path / "draft"), target_config=target.config)
    assert reloaded.fc.weight.dtype == torch.bfloat16
    expected = copy.deepcopy(draft).to(torch.bfloat16)
    tokens, _, feats = cache[0]
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    block = torch.full((1, BLOCK), draft.mask_token_id)
    block[0, 0] = tokens[20]
    with torch.no_grad():
        logits = []
        for model in (expected, reloaded):
            ctx = model.project_context(feats[None, :20])
            hidden = model(F.embedding(block, embed).to(torch.bfloat16), ctx, torch.arange(20 + BLOCK)[None])
            logits.append(F.linear(hidden.float(), head))
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(draft_from_checkpoint(trainer.out_dir).fc.weight, draft.fc.weight.float())


def test_resume_continues_exactly(setup):
    straight = make_trainer(setup, "straight", max_steps=12, log_every=4)
    straight.train()
    interrupted = make_trainer(setup, "resumed", max_steps=12, log_every=4, checkpoint_every=5)
    real_step = interrupted.train_step

    def crash_after_7(batch):
        if interrupted.step == 7:
            raise KeyboardInterrupt
        return real_step(batch)

    interrupted.train_step = crash_after_7
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = make_trainer(setup, "resumed", max_steps=12, log_every=4, checkpoint_every=5)
    assert resumed.load_checkpoint() and resumed.step == 5
    resumed.train()
    for (name, a), b in zip(straight.draft.named_parameters(), resumed.draft.parameters()):
        assert torch.equal(a, b), name
