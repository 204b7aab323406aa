"""On-disk cache of the target's hidden states that the drafter is conditioned on.

The target is frozen, so its features for a training sequence never change:
computing them once turns every training step into a draft-only forward/backward.
Features of the chosen layers (id i = the output of decoder layer i, the residual
stream vLLM captures; read with the reference loop's hooks so training and
evaluation see identical features) are concatenated per token and written in
shards of `shard_size` sequences:

    meta.json                     target, layer ids, dtype, shard list
    00000.tokens.npy   int32 [T]  all tokens of the shard's sequences, back to back
    00000.offsets.npy  int64 [n+1]
    00000.prompt_lens.npy int32 [n]
    00000.features.npy [T, L*D]   bf16 (stored as uint16 bits), fp16 or fp32
    00000.done                    written last: a shard without it is recomputed

Shards are opened memory-mapped, so a cache larger than RAM trains fine, and a run
interrupted mid-build resumes at the first unfinished shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import torch
from tqdm import tqdm

from vllm_dflash.reference.features import TargetFeatures
from vllm_dflash.training.data import Sample
from vllm_dflash.training.distributed import barrier

CACHE_KIND = "vllm-dflash-features/v1"
STORAGE = {"bf16": (np.uint16, torch.bfloat16), "fp16": (np.float16, torch.float16),
           "fp32": (np.float32, torch.float32)}


def data_fingerprint(samples: list[Sample]) -> str:
    h = hashlib.sha1()
    for s in samples:
        h.update(np.asarray([s.prompt_len, *s.tokens], dtype=np.int64).tobytes())
    return h.hexdigest()


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    features: TargetFeatures) -> torch.Tensor:
    """[batch, seq, L * hidden] from one transformers forward (right-padded batch)."""
    target(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    return features.pop()


def padded_features(target, token_lists: list[list[int]], features: TargetFeatures) -> torch.Tensor:
    """[n, max length, L * hidden] on the target's device for sequences of different lengths."""
    device = next(target.parameters()).device
    width = max(len(t) for t in token_lists)
    ids = torch.zeros(len(token_lists), width, dtype=torch.long)
    mask = torch.zeros(len(token_lists), width, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        ids[row, :len(tokens)] = torch.as_tensor(tokens)
        mask[row, :len(tokens)] = 1
    return target_features(target, ids.to(device), mask.to(device), features)


def _to_numpy(x: torch.Tensor, dtype: str) -> np.ndarray:
    np_dtype, torch_dtype = STORAGE[dtype]
    x = x.to(torch_dtype).contiguous()
    return x.view(torch.int16).numpy().view(np_dtype) if dtype == "bf16" else x.numpy()


def _save(path: str, array: np.ndarray) -> None:
    tmp = path + ".tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def check_cache_fits(cache_dir: str, samples: list[Sample], feature_dim: int, dtype: str) -> None:
    """Refuse a cache that the disk under `cache_dir` cannot hold (shards already written count as held)."""
    need = sum(len(s.tokens) for s in samples) * feature_dim * np.dtype(STORAGE[dtype][0]).itemsize
    done = 0
    if os.path.isdir(cache_dir):
        done = sum(os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir)
                   if f.endswith(".features.npy"))
    parent = cache_dir
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent) or "."
    free = shutil.disk_usage(parent).free
    if need - done > free:
        raise ValueError(f"the feature cache needs {need / 1e9:.1f} GB ({dtype}, {feature_dim} values per token) "
                         f"but {parent} has {free / 1e9:.1f} GB free: use --features online (the target "
                         f"computes features at every step), fewer --num-prompts, or another --out")


def build_feature_cache(target, samples: list[Sample], layer_ids: list[int], cache_dir: str,
                        shard_size: int = 256, dtype: str = "bf16", batch_tokens: int = 8192,
                        target_name: str = "", rank: int = 0, world_size: int = 1) -> "FeatureCache":
    """Compute (or finish computing) the cache for `samples`; returns it opened.

    Under torchrun every rank computes the unfinished shards `i` with
    `i % world_size == rank` and all wait for each other before opening the cache.
    """
    if dtype not in STORAGE:
        raise ValueError(f"feature dtype={dtype!r}: choose one of {', '.join(STORAGE)}")
    if not samples:
        raise ValueError("no training samples to compute features for")
    os.makedirs(cache_dir, exist_ok=True)
    hidden = target.config.get_text_config().hidden_size
    num_shards = -(-len(samples) // shard_size)
    meta = {"kind": CACHE_KIND, "target": target_name, "layer_ids": list(layer_ids), "hidden_size": hidden,
            "feature_dim": hidden * len(layer_ids), "dtype": dtype, "shard_size": shard_size,
            "num_sequences": len(samples), "num_shards": num_shards,
            "fingerprint": data_fingerprint(samples)}
    meta_path = os.path.join(cache_dir, "meta.json")
    if rank == 0 and not os.path.exists(meta_path):
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(meta_path + ".tmp", meta_path)
    barrier()
    with open(meta_path) as f:
        found = json.load(f)
    if found != meta:
        diff = {k: (found.get(k), v) for k, v in meta.items() if found.get(k) != v}
        raise ValueError(f"feature cache {cache_dir} holds other data {diff} (cached, wanted); "
                         "use another --out directory or delete the cache")
    todo = [i for i in range(rank, num_shards, world_size)
            if not os.path.exists(os.path.join(cache_dir, f"{i:05d}.done"))]
    bar = tqdm(total=sum(min(shard_size, len(samples) - i * shard_size) for i in todo),
               desc="target features", unit="seq", disable=rank != 0)
    hooks = TargetFeatures(target, layer_ids)
    for shard in todo:
        part = samples[shard * shard_size:(shard + 1) * shard_size]
        lengths = [len(s.tokens) for s in part]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        feats = np.empty((int(offsets[-1]), meta["feature_dim"]), dtype=STORAGE[dtype][0])
        order = sorted(range(len(part)), key=lambda i: lengths[i])   # batch similar lengths
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * lengths[order[end]] <= batch_tokens:
                end += 1
            idx = order[start:end]
            out = padded_features(target, [part[i].tokens for i in idx], hooks).cpu()
            for row, i in enumerate(idx):
                feats[offsets[i]:offsets[i + 1]] = _to_numpy(out[row, :lengths[i]], dtype)
            bar.update(len(idx))
            start = end
        base = os.path.join(cache_dir, f"{shard:05d}")
        _save(base + ".tokens.npy", np.concatenate([np.asarray(s.tokens, dtype=np.int32) for s in part]))
        _save(base + ".offsets.npy", offsets)
        _save(base + ".prompt_lens.npy", np.asarray([s.prompt_len for s in part], dtype=np.int32))
        _save(base + ".features.npy", feats)
        with open(base + ".done", "w") as f:
            json.dump({"sequences": len(part), "tokens": int(offsets[-1])}, f)
    hooks.remove()
    bar.close()
    barrier()
    return FeatureCache(cache_dir)


class FeatureCache:
    """Read side: sequence i -> (tokens [T] long, prompt_len, features [T, L*D])."""

    def __init__(self, cache_dir: str):
        meta_path = os.path.join(cache_dir, "meta.json")
        if not os.path.exists(meta_path):
            raise ValueError(f"{cache_dir} is not a feature cache (no meta.json); build it first")
        with open(meta_path) as f:
            self.meta = json.load(f)
        self.layer_ids = self.meta["layer_ids"]
        self.torch_dtype = STORAGE[self.meta["dtype"]][1]
        self.shards = []
        for i in range(self.meta["num_shards"]):
            base = os.path.join(cache_dir, f"{i:05d}")
            if not os.path.exists(base + ".done"):
                raise ValueError(f"feature cache {cache_dir}: shard {i} is unfinished; rerun the build to resume")
            self.shards.append({k: np.load(f"{base}.{k}.npy", mmap_mode="r")
                                for k in ("tokens", "offsets", "prompt_lens", "features")})
        self.index = [(s, j) for s, shard in enumerate(self.shards) for j in range(len(shard["prompt_lens"]))]
        self.lengths = [int(self.shards[s]["offsets"][j + 1] - self.shards[s]["offsets"][j])
                        for s, j in self.index]

    def __len__(self) -> int:
        return len(self.index)

    def items(self, indices: list[int]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        return [self[i] for i in indices]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        s, j = self.index[i]
        shard = self.shards[s]
        a, b = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
        tokens = torch.from_numpy(np.array(shard["tokens"][a:b], dtype=np.int64))
        feats = torch.from_numpy(np.array(shard["features"][a:b]))
        if self.meta["dtype"] == "bf16":
            feats = feats.view(torch.bfloat16)
        return tokens, int(shard["prompt_lens"][j]), feats

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


class OnlineFeatures:
    """The read side of `FeatureCache` without the cache: the target computes a step's
    features when the step asks for them.

    A cache costs disk per token of L * hidden values (Qwen3-8B, 5 layers, bf16: 40 KB,
    so 800K sequences of 2K tokens would need 67 TB); online features cost a target
    forward per step instead, on the device that trains (each rank its own copy).
    """

    def __init__(self, target, samples: list[Sample], layer_ids: list[int], dtype: str):
        if dtype not in STORAGE:
            raise ValueError(f"feature dtype={dtype!r}: choose one of {', '.join(STORAGE)}")
        if not samples:
            raise ValueError("no training samples to compute features for")
        self.target, self.samples, self.layer_ids = target, samples, list(layer_ids)
        self.meta = {"kind": "online", "layer_ids": self.layer_ids, "dtype": dtype}
        self.torch_dtype = STORAGE[dtype][1]
        self.lengths = [len(s.tokens) for s in samples]
        self._hooks = TargetFeatures(target, self.layer_ids)

    def __len__(self) -> int:
        return len(self.samples)

    @torch.no_grad()
    def items(self, indices: list[int]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """One target forward for all of `indices` (features stay on the target's device)."""
        part = [self.samples[i] for i in indices]
        out = padded_features(self.target, [s.tokens for s in part], self._hooks).to(self.torch_dtype)
        return [(torch.as_tensor(s.tokens, dtype=torch.long, device=out.device), s.prompt_len,
                 out[row, :len(s.tokens)]) for row, s in enumerate(part)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        return self.items([i])[0]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)
