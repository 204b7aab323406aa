"""DFlash draft model in plain PyTorch: the oracle for the serving path and
the model the training pipeline trains.

Shapes: b = batch, c = context tokens, q = block (query) tokens, D = hidden
size, L = number of target features, H / Hkv = query / key-value heads, d =
head_dim.

Data flow of one draft forward::

    target_hidden [b, c, L*D] --project_context (fc, hidden_norm)--> context [b, c, D]
    noise_embedding [b, q, D] = target.embed_tokens([last token, MASK, ..., MASK])
    each layer:  Q     from input_layernorm(block hidden)
                 K, V  from [context (not re-normed); input_layernorm(block hidden)]
                 k_norm / q_norm per head, RoPE at absolute positions,
                 non-causal attention (the block sees all context and itself)
    final norm -> hidden [b, q, D]; the caller applies the target's lm_head.

The embedding and LM head are the target's, so they are not part of the draft.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dflash.config import DFlashConfig, parse_draft_config


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_parameters(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4 configs
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 1_000_000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) at absolute positions.

    The default schedule is computed here; scaled schedules (llama3, yarn, ...)
    take their inverse frequencies from transformers so they match the target.
    """

    def __init__(self, config: Any, head_dim: int):
        super().__init__()
        params = _rope_parameters(config)
        if params["rope_type"] == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round it.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, heads, d], positions [..., n] -> x rotated (computed in float32)."""
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # [..., n, 1, d]
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)


class ContextKVCache:
    """Per-layer K/V of the context tokens seen so far: plain tensors grown by
    `append` and cut by `crop`.

    Tensors are [b, n, Hkv, d]. Only context K/V live here: block K/V are
    recomputed every round because the block changes.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[-3]

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new context K/V for one layer; return the layer's full K/V."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-3)
            v = torch.cat([self.values[layer], v], dim=-3)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first `length` context positions of every layer."""
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :, :], v[..., :length, :, :]


class DFlashAttention(nn.Module):
    """Q from the block; K/V from context features and the block (KV injection)."""

    def __init__(self, config: Any):
        super().__init__()
        d_model = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or d_model // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d_model, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d_model, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim)

    def _split_heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n_heads, self.head_dim)

    def context_kv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens: hidden [..., n, D], positions [..., n] -> k, v [..., n, Hkv, d].

        k is k_norm'ed and rotated, v is raw: exactly what a paged cache stores.
        Used for context features (already projected, not re-normed) and for
        the block's own (input_layernorm'ed) hidden states.
        """
        k = self.k_norm(self._split_heads(self.k_proj(hidden), self.num_kv_heads))
        v = self._split_heads(self.v_proj(hidden), self.num_kv_heads)
        return self.rotary(k, positions), v

    def forward(
        self,
        x: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        attn_mask: Any = None,
    ) -> torch.Tensor:
        """x [b, q, D] (normed block), ctx_k/ctx_v [b, c, Hkv, d] -> [b, q, D]."""
        b, q_len, _ = x.shape
        q = self.q_norm(self._split_heads(self.q_proj(x), self.num_heads))
        q = self.rotary(q, block_positions)
        blk_k, blk_v = self.context_kv(x, block_positions)
        k = torch.cat([ctx_k.expand(b, -1, -1, -1), blk_k], dim=1)
        v = torch.cat([ctx_v.expand(b, -1, -1, -1), blk_v], dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, n, d]
        out = _attention(q, k, v, attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


_COMPILED_FLEX: Any = None


def _flex_attention():
    """flex_attention compiled once (on CUDA): eager flex attention is a slow
    reference path that materialises the scores; compiled, it becomes one fused
    kernel that skips the BlockMask's empty tiles."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any) -> torch.Tensor:
    """Non-causal GQA attention; a flex-attention BlockMask selects flex attention."""
    if attn_mask is not None and type(attn_mask).__name__ == "BlockMask":
        if q.is_cuda:
            return _flex_attention()(q, k, v, block_mask=attn_mask, enable_gqa=True)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)  # CPU: inference only
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)


class DFlashMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        d_model, d_ff = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def context_kv(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V of this layer (see DFlashAttention.context_kv)."""
        return self.self_attn.context_kv(context, positions)

    def forward(self, x, block_positions, ctx_k, ctx_v, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), block_positions, ctx_k, ctx_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _as_hf_config(config: Any):
    if isinstance(config, dict):
        from transformers import Qwen3Config

        return Qwen3Config.from_dict(config)
    return config


class DFlashDraftModel(nn.Module):
    """DFlash draft: fc + hidden_norm on target features, N KV-injected layers, norm.

    Stable interface (used by the spec loop, the serving oracle tests and training):
      - `project_context(target_hidden [.., c, L*D]) -> [.., c, D]`
      - `forward(noise_embedding [b, q, D], context [b, c, D], position_ids [b or 1, c+q],
         attn_mask=None, kv_cache=None) -> hidden [b, q, D]`
      - `context_kv(context, positions) -> [(k, v)] per layer`, k/v [.., c, Hkv, d]
      - `new_kv_cache() -> ContextKVCache`
    Parameter names follow z-lab's checkpoints exactly (see checkpoint.py).
    """

    def __init__(self, config: Any):
        super().__init__()
        config = _as_hf_config(config)
        self.config = config
        self.dflash: DFlashConfig = parse_draft_config(config)
        d_model = config.hidden_size
        self.fc = nn.Linear(self.dflash.num_features * d_model, d_model, bias=False)
        self.hidden_norm = RMSNorm(d_model, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(d_model, config.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Transformers-style init: normal(0, initializer_range) linears, unit norms."""
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.dflash.block_size

    @property
    def mask_token_id(self) -> int:
        return self.dflash.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.dflash.target_layer_ids

    def new_kv_cache(self) -> ContextKVCache:
        return ContextKVCache(len(self.layers))

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [.., c, L*D] -> context [.., c, D]."""
        expected = self.fc.in_features
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features per token; this draft "
                f"expects {expected} = {self.dflash.num_features} target layers "
                f"{list(self.target_layer_ids)} x hidden_size {self.config.hidden_size}"
            )
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V (k normed and rotated) of projected context."""
        return [layer.context_kv(context, positions) for layer in self.layers]

    def forward(
        self,
        noise_embedding: torch.Tensor,
        context: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: Any = None,
        kv_cache: ContextKVCache | None = None,
    ) -> torch.Tensor:
        """Draft hidden states of the block.

        noise_embedding [b, q, D]: target embeddings of the block tokens.
        context [b, c, D]: projected context (project_context); with a kv_cache
            only the c *new* context tokens, whose K/V are appended to it.
        position_ids [b or 1, c+q]: absolute positions of the new context, then the block.
        attn_mask: None (all keys visible), a boolean [b or 1, 1, q, n_kv] mask
            (True = attend) over keys [cached context; new context; block], or a
            flex-attention BlockMask with the same layout.
        Returns the final-normed hidden states [b, q, D].
        """
        c, q_len = context.shape[-2], noise_embedding.shape[-2]
        if position_ids.shape[-1] != c + q_len:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions; expected context "
                f"({c}) + block ({q_len}) = {c + q_len}"
            )
        ctx_pos, blk_pos = position_ids[..., :c], position_ids[..., c:]
        x = noise_embedding
        for i, layer in enumerate(self.layers):
            k, v = layer.context_kv(context, ctx_pos)
            if kv_cache is not None:
                k, v = kv_cache.append(i, k, v)
            x = layer(x, blk_pos, k, v, attn_mask)
        return self.norm(x)
