"""Draft cost vs block size (the DFlash paper's Figure 3), measured in torch.

One DFlash round drafts B-1 tokens with one forward of the block
[last token, MASK x (B-1)] over the cached context. An autoregressive draft
of the same width and depth needs B-1 sequential single-token forwards for
the same tokens, each feeding its argmax to the next. Both are built from the
reference model's modules (vllm_dflash.reference) with random weights, run in
steady state (a fixed cached context, one new context token per round) and
include the embedding lookup, the LM head and the argmax, so the only
difference is the decoding schedule.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dflash.reference.model import ContextKVCache, DFlashDraftModel


class DraftPair(nn.Module):
    """A random DFlash draft plus the target-shared embedding and LM head."""

    def __init__(self, config: Any):
        super().__init__()
        self.draft = DFlashDraftModel(config)
        d, vocab = config.hidden_size, config.vocab_size
        self.embed = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.mask_token_id = self.draft.mask_token_id
        self.num_features = self.draft.dflash.num_features

    @torch.inference_mode()
    def dflash_round(self, last_token: torch.Tensor, features: torch.Tensor, pos: int,
                     cache: ContextKVCache) -> torch.Tensor:
        """Draft B-1 tokens in one forward. features [1, 1, L*D] of the newest context token."""
        block = self.draft.block_size
        ctx_len = cache.length
        tokens = torch.full((1, block), self.mask_token_id, dtype=torch.long)
        tokens[0, 0] = last_token
        positions = torch.arange(pos, pos + 1 + block).unsqueeze(0)
        hidden = self.draft(self.embed(tokens), self.draft.project_context(features), positions, kv_cache=cache)
        cache.crop(ctx_len)  # steady state: the next round sees the same context length
        return self.lm_head(hidden[:, 1:]).argmax(-1)

    @torch.inference_mode()
    def autoregressive_round(self, last_token: torch.Tensor, num_tokens: int, pos: int,
                             cache: ContextKVCache) -> torch.Tensor:
        """Draft `num_tokens` tokens with sequential causal single-token forwards."""
        ctx_len = cache.length
        token, out = last_token.view(1, 1), []
        for step in range(num_tokens):
            x = self.embed(token)
            p = torch.tensor([[pos + step]])
            for i, layer in enumerate(self.draft.layers):
                x = x + self._causal_attention(layer, layer.input_layernorm(x), p, cache, i)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            token = self.lm_head(self.draft.norm(x)).argmax(-1)
            out.append(token)
        cache.crop(ctx_len)
        return torch.cat(out, dim=-1)

    @staticmethod
    def _causal_attention(layer: nn.Module, h: torch.Tensor, positions: torch.Tensor,
                          cache: ContextKVCache, index: int) -> torch.Tensor:
        attn = layer.self_attn
        q = attn.q_proj(h).view(1, 1, attn.num_heads, attn.head_dim)
        q = attn.rotary(attn.q_norm(q), positions)
        k, v = cache.append(index, *attn.context_kv(h, positions))  # the new token joins the cache
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # one query: causal by construction
        return attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))


def _prefill(pair: DraftPair, context_len: int) -> ContextKVCache:
    cache = pair.draft.new_kv_cache()
    d = pair.draft.config.hidden_size
    ctx = torch.randn(1, context_len, d)
    positions = torch.arange(context_len).unsqueeze(0)
    with torch.inference_mode():
        for i, (k, v) in enumerate(pair.draft.context_kv(ctx, positions)):
            cache.append(i, k, v)
    return cache


def _median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(base_config: Any, block_sizes: Sequence[int] = (4, 8, 16), layer_counts: Sequence[int] = (1, 3, 5),
            context_len: int = 128, iters: int = 20, warmup: int = 3, threads: int | None = None,
            seed: int = 0, progress: bool = True) -> dict:
    """Median draft time per round (ms) of DFlash and of the autoregressive draft.

    `base_config` is a DFlash draft config (e.g. from `new_draft_config(target)`):
    width, heads, vocab and target features come from it; block size and
    layer count are swept.
    """
    from tqdm import tqdm

    if any(b < 2 for b in block_sizes):
        raise ValueError(f"draft-cost block sizes {list(block_sizes)}: each must be >= 2")
    if any(n < 1 for n in layer_counts):
        raise ValueError(f"draft-cost layer counts {list(layer_counts)}: each must be >= 1")
    if context_len < 1 or iters < 1:
        raise ValueError(f"draft-cost context_len={context_len}, iters={iters}: both must be >= 1")
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rows = []
    try:
        grid = [(n, b) for n in layer_counts for b in block_sizes]
        for n_layers, block in tqdm(grid, desc="draft cost", disable=not progress):
            cfg = base_config.__class__.from_dict(
                {**base_config.to_dict(), "num_hidden_layers": n_layers, "block_size": block,
                 "layer_types": None})
            pair = DraftPair(cfg).eval()
            features = torch.randn(1, 1, pair.num_features * cfg.hidden_size)
            last = torch.tensor(7)
            cache = _prefill(pair, context_len)
            dflash_ms = _median_ms(lambda: pair.dflash_round(last, features, context_len, cache), iters, warmup)
            ar_ms = _median_ms(lambda: pair.autoregressive_round(last, block - 1, context_len, cache), iters, warmup)
            rows.append({"layers": n_layers, "block_size": block, "draft_tokens": block - 1,
                         "dflash_ms": dflash_ms, "autoregressive_ms": ar_ms, "ar_over_dflash": ar_ms / dflash_ms})
    finally:
        torch.set_num_threads(old_threads)
    return {
        "hidden_size": base_config.hidden_size, "vocab_size": base_config.vocab_size,
        "intermediate_size": base_config.intermediate_size, "context_len": context_len,
        "threads": threads or old_threads, "iters": iters, "dtype": "float32", "device": "cpu",
        "rows": rows,
    }
