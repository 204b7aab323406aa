"""`--features online`: the target computes a step's features instead of a disk cache.

It must hand the trainer what the cache would (same sequences, same features),
train the same weights, and the cache must refuse to start when the disk cannot
hold it, pointing at online features.
"""

import shutil
from collections import namedtuple

import pytest
import torch

from helpers import random_draft, tiny_target
from test_training_train import BLOCK, counting_samples
from vllm_dflash.training.features import OnlineFeatures, build_feature_cache, check_cache_fits
from vllm_dflash.training.trainer import TrainConfig, Trainer, collate


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    target = tiny_target(vocab_size=128, hidden_size=64, num_layers=4)
    layer_ids = list(random_draft(target, num_layers=1, block_size=BLOCK).target_layer_ids)
    samples = counting_samples(60, seed=5)
    cache = build_feature_cache(target, samples, layer_ids, str(root / "features"), shard_size=16, dtype="fp32")
    return root, target, cache, OnlineFeatures(target, samples, layer_ids, "fp32")


def test_online_features_equal_the_cache(sources):
    _, _, cache, online = sources
    assert len(online) == len(cache) and online.lengths == cache.lengths and online.layer_ids == cache.layer_ids
    indices = [3, 17, 0, 42, 59]   # mixed lengths: one padded forward
    for (t_c, p_c, f_c), (t_o, p_o, f_o) in zip(cache.items(indices), online.items(indices)):
        assert torch.equal(t_c, t_o) and p_c == p_o
        torch.testing.assert_close(f_o, f_c, atol=1e-5, rtol=1e-5)
    a, b = collate(cache, indices), collate(online, indices)
    assert a.seq_lens == b.seq_lens and a.prompt_lens == b.prompt_lens and torch.equal(a.tokens, b.tokens)


def test_training_on_online_features_follows_the_cached_run(sources):
    root, target, cache, online = sources
    losses = []
    for name, source in (("cache", cache), ("online", online)):
        draft = random_draft(target, num_layers=1, block_size=BLOCK, seed=3, initializer_range=0.02)
        cfg = TrainConfig(blocks_per_seq=8, batch_size=8, lr=3e-3, max_steps=12, log_every=4, checkpoint_every=0,
                          val_fraction=0.1, autocast="fp32")
        trainer = Trainer(draft.train(), target.get_input_embeddings().weight,
                          target.get_output_embeddings().weight, source, cfg, str(root / name))
        trainer.train()
        losses.append([r["train"]["loss"] for r in trainer.history if "train" in r])
    assert len(losses[0]) == 3
    # Features agree to ~1e-6 (different padding per forward); 12 steps keep losses within 1e-4.
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_a_cache_the_disk_cannot_hold_names_online_features(tmp_path, monkeypatch):
    samples = counting_samples(10)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ValueError, match=r"feature cache needs .* GB \(bf16, 20480 values per token\).*"
                                         r"--features online"):
        check_cache_fits(str(tmp_path / "features"), samples, 20480, "bf16")
    check_cache_fits(str(tmp_path / "features"), samples[:0], 20480, "bf16")   # nothing to store fits
