"""Prompt loading, and the sharded, memory-mapped, resumable target feature cache."""

import json
import os

import numpy as np
import pytest
import torch

from helpers import tiny_target
from vllm_dflash.reference import TargetFeatures
from vllm_dflash.training import features as features_mod
from vllm_dflash.training.data import Sample, load_prompts, usable
from vllm_dflash.training.features import FeatureCache, build_feature_cache



def test_prompt_files(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt_ids": [1, 2, 3], "category": "math"}\n\n{"prompt_ids": [4]}\n')
    prompts = load_prompts(str(jl))
    assert [(p.prompt_ids, p.category) for p in prompts] == [([1, 2, 3], "math"), ([4], "default")]
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"code": [{"prompt_ids": [7, 8]}], "prose": [{"prompt_ids": [9]}]}))
    assert [(p.prompt_ids, p.category) for p in load_prompts(str(js))] == [([7, 8], "code"), ([9], "prose")]
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ValueError, match="need the target's tokenizer"):
        load_prompts(str(bad), tokenizer=None)
    bad.write_text('{"question_ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a prompt row needs one of prompt_ids"):
        load_prompts(str(bad))


def test_usable_truncates_and_drops_short_responses():
    samples = [Sample(list(range(30)), 10), Sample(list(range(20)), 10), Sample(list(range(100)), 4)]
    # B=8: the 20-token sample has anchors 10..12; the 100-token one is cut to 64.
    assert [len(s.tokens) for s in usable(samples, block_size=8, max_len=64)] == [30, 20, 64]
    # B=16: a 10-token response cannot hold [anchor + 15 drafts]: dropped.
    assert [len(s.tokens) for s in usable(samples, block_size=16, max_len=64)] == [30, 64]


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1)


def _samples(n=7):
    gen = torch.Generator().manual_seed(0)
    return [Sample(torch.randint(0, 64, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen).tolist(),
                   prompt_len=2) for _ in range(n)]


def test_cache_matches_a_direct_forward(tmp_path, target):
    samples = _samples()
    cache = build_feature_cache(target, samples, [0, 2], str(tmp_path), shard_size=3, batch_tokens=64)
    assert len(cache) == 7 and len(cache.shards) == 3
    assert os.path.exists(tmp_path / "00002.done") and not os.path.exists(tmp_path / "00003.done")
    with TargetFeatures(target, [0, 2]) as hooks, torch.no_grad():
        for i, s in enumerate(samples):
            target(input_ids=torch.tensor([s.tokens]))
            direct = hooks.pop()[0].to(torch.bfloat16)
            tokens, prompt_len, feats = cache[i]
            assert tokens.tolist() == s.tokens and prompt_len == 2
            assert feats.dtype == torch.bfloat16 and feats.shape == (len(s.tokens), 64)
            # Batched (right-padded) forward vs one sequence alone: same features up to bf16 rounding.
            torch.testing.assert_close(feats.float(), direct.float(), atol=1e-2, rtol=1e-2)
    assert isinstance(cache.shards[0]["features"], np.memmap)   # read from disk on demand


def test_cache_resumes_unfinished_shards_only(tmp_path, target, monkeypatch):
    samples = _samples()
    build_feature_cache(target, samples, [1], str(tmp_path), shard_size=3)
    before = [FeatureCache(str(tmp_path))[i][2].clone() for i in range(7)]
    os.remove(tmp_path / "00001.done")           # as if interrupted while writing shard 1
    calls = []
    real = features_mod.target_features

    def counted(target, ids, *args):
        calls.append(ids.shape[0])
        return real(target, ids, *args)

    monkeypatch.setattr(features_mod, "target_features", counted)
    cache = build_feature_cache(target, samples, [1], str(tmp_path), shard_size=3)
    assert sum(calls) == 3                       # only shard 1's three sequences were recomputed
    for i in range(7):
        assert torch.equal(cache[i][2], before[i])
    with pytest.raises(ValueError, match="holds other data"):
        build_feature_cache(target, samples[:5], [1], str(tmp_path), shard_size=3)
    with pytest.raises(ValueError, match="unfinished"):
        os.remove(tmp_path / "00000.done")
        FeatureCache(str(tmp_path))
