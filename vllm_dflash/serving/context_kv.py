"""The draft's context K/V: target features -> K/V of every draft layer in vLLM's paged cache.

Per step, for the newly verified tokens only: `fc` + `hidden_norm` of the
concatenated target hidden states, one K/V projection of all layers
(`DFlashModel.context_kv_proj`), then k_norm, RoPE at the tokens' absolute
positions and the cache stores. On the fast path the last three are one native
call (`ops.store_context_kv_fused`); backends or RoPE variants it does not
cover take the torch path (`norm_rope`, then per layer
`ops.store_context_kv_layer` or the backend's own cache writer). The writer
runs outside the compiled graph: its shapes change every step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm_dflash import ops
from vllm_dflash.serving import context_precision, gemm_rows

if TYPE_CHECKING:
    from vllm_dflash.serving.draft_model import DFlashAttention, DFlashModel

logger = logging.getLogger("vllm.vllm_dflash")  # under vLLM's logger, so its handler prints it

# vLLM attention backend name -> KV cache layout understood by ops.store_context_kv_layer.
CACHE_LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "flash"}


def cache_layout(attn: DFlashAttention) -> str | None:
    """ops.store_context_kv_layer layout of this layer's cache; None for other backends."""
    return CACHE_LAYOUTS.get(attn.attn.get_attn_backend().get_name())


def store_layer_kv(attn: DFlashAttention, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store K/V at `slot_mapping` (-1 = skip) in one layer's paged cache."""
    layout = cache_layout(attn)
    if layout is not None:
        ops.store_context_kv_layer(key, value, attn.attn.kv_cache, slot_mapping, layout)
        return
    # Any other backend: its own cache writer (it skips negative slots).
    attn.attn.impl.do_kv_cache_update(attn.attn, key, value, attn.attn.kv_cache, slot_mapping)


def rope_keys(rope: nn.Module, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """RoPE on keys with the platform's kernel. This path runs outside the
    compiled graph, where vLLM's CustomOp dispatch (custom ops off under
    torch.compile) would pick the slow native version."""
    if keys.device.type == "cuda" and hasattr(rope, "forward_cuda"):
        return rope.forward_cuda(positions, keys, None)[0]
    if keys.device.type == "cpu" and hasattr(rope, "forward_cpu"):
        return rope.forward_cpu(positions, keys, None)[0]
    return rope.forward_native(positions, keys, None)[0]


def is_table_rope(rope: nn.Module) -> bool:
    """True for vLLM's RotaryEmbedding and the subclasses that only change its
    cos_sin_cache (Llama3, YaRN, linear/NTK scaling): their rotation is a
    plain cos_sin_cache lookup, which ops.store_context_kv_fused does itself."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    cls = type(rope)
    methods = ("forward", "forward_native", "forward_static", "forward_cpu", "forward_cuda")
    return isinstance(rope, RotaryEmbedding) and all(getattr(cls, m) is getattr(RotaryEmbedding, m) for m in methods)


def _holds_weight(linear: torch.nn.Module) -> bool:
    """Whether a linear layer still holds its [out, in] weight: vLLM's CPU linears hand it to
    oneDNN where the machine has a native GEMM for the dtype (AVX512_BF16 / AMX for bf16) and
    leave an empty tensor behind; the model's own dtype is then the fast one anyway."""
    weight = getattr(linear, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0


class ContextKVWriter:
    """Computes and stores context K/V for a DFlashModel (which owns the weights)."""

    def __init__(self, model: DFlashModel):
        self.model = model
        # (first layer's cache, dtype, store_context_kv_fused arguments or None): see _fused_args.
        self._fused_plan: tuple | None = None
        self._fp32_weights: tuple | None = None  # decided at the first context write: see _choose_precision
        # Row counts up to this are padded to serving.gemm_rows' grid for the GEMMs (None: never).
        self.gemm_row_limit: int | None = None

    def attention_layers(self) -> list[DFlashAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def stack_weights(self) -> None:
        """After the checkpoint is loaded: fill context_kv_proj with every
        layer's K/V rows of qkv_proj and stack the layers' k_norm weights."""
        model, attns = self.model, self.attention_layers()
        model.k_norm_weight = torch.stack([a.k_norm.weight.data for a in attns])  # [L, d]
        if model.context_kv_proj is None:
            return
        model.context_kv_proj.weight.data.copy_(torch.cat([a.qkv_proj.weight.data[a.q_size:] for a in attns]))
        if model.context_kv_proj.bias is not None:
            model.context_kv_proj.bias.data.copy_(torch.cat([a.qkv_proj.bias.data[a.q_size:] for a in attns]))

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """Raw K/V (before k_norm and RoPE) of context tokens in every layer,
        [n, L, 2, H_kv, d]: fc + hidden_norm, then one K/V projection (in
        float32 where that is faster here: `serving.context_precision`)."""
        attns = self.attention_layers()
        shape = (target_features.shape[0], len(attns), 2, attns[0].num_kv_heads, attns[0].head_dim)
        if self._fp32_weights is None:
            self._fp32_weights = self._choose_precision(target_features)
        if self._fp32_weights:
            return context_precision.project_fp32(target_features, *self._fp32_weights).to(
                target_features.dtype).view(shape)
        rows = shape[0]
        padded = rows if self.gemm_row_limit is None else gemm_rows.padded_rows(rows, self.gemm_row_limit)
        if padded != rows:
            target_features = torch.nn.functional.pad(target_features, (0, 0, 0, padded - rows))
        return self._project_native(target_features)[:rows].view(shape)

    def _choose_precision(self, target_features: torch.Tensor) -> tuple:
        """() for the model's own dtype, else the float32 weights of project_fp32
        (measured once, at the first context write: the write runs every step)."""
        model = self.model
        norm, kv_proj = model.hidden_norm, model.context_kv_proj
        plain = (kv_proj is not None and norm.has_weight and norm.variance_size_override is None
                 and _holds_weight(model.fc) and _holds_weight(kv_proj))
        if target_features.device.type != "cpu" or target_features.dtype == torch.float32 or not plain:
            return ()
        bias = getattr(kv_proj, "bias", None)
        weights = (model.fc.weight.detach().float(), norm.weight.detach().float(), norm.variance_epsilon,
                   kv_proj.weight.detach().float(), None if bias is None else bias.detach().float())
        sample = target_features[:64]
        if sample.shape[0] < 16:  # decide on a batch that stands for a step, not on one token
            sample = sample.repeat((16 + sample.shape[0] - 1) // sample.shape[0], 1)[:16]
        choice = context_precision.choose_faster({
            "native": lambda: self._project_native(sample),
            "float32": lambda: context_precision.project_fp32(sample, *weights).to(sample.dtype),
        })
        logger.info("vllm-dflash: context K/V projection in %s (measured faster than %s here)",
                    choice if choice == "float32" else str(target_features.dtype),
                    str(target_features.dtype) if choice == "float32" else "float32")
        return weights if choice == "float32" else ()

    def _project_native(self, target_features: torch.Tensor) -> torch.Tensor:
        model = self.model
        context = model.fc(target_features)
        norm = model.hidden_norm
        if norm.has_weight and norm.variance_size_override is None and norm.weight.dtype == context.dtype:
            # vLLM's RMSNorm math in one native call (the module dispatches ~8
            # torch ops here, outside any compiled graph).
            context = ops.rms_norm(context, norm.weight, norm.variance_epsilon)
        else:
            context = norm(context)
        if model.context_kv_proj is not None:
            return model.context_kv_proj(context)
        # quantized drafts: packed weights cannot be sliced, project per layer
        return torch.stack([a.qkv_proj(context)[0][:, a.q_size:] for a in self.attention_layers()], dim=1)

    def norm_rope(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of context tokens in every layer, [n, L, H_kv, d]
        each, from `project`'s output: k_norm with the layers' stacked weights,
        RoPE at the tokens' positions, in torch (the fused native version is
        ops.store_context_kv_fused)."""
        attn = self.attention_layers()[0]
        k_norm_weight = self.model.k_norm_weight
        n, num_layers = kv.shape[0], kv.shape[1]
        k, v = kv[:, :, 0], kv[:, :, 1]
        # k_norm of every layer in one pass (same arithmetic as vLLM's RMSNorm).
        k32 = k.float()
        k32 = k32 * torch.rsqrt(k32.pow(2).mean(dim=-1, keepdim=True) + attn.k_norm.variance_epsilon)
        k = (k32.to(k_norm_weight.dtype) * k_norm_weight[:, None, :]).to(kv.dtype)
        # All layers share one RoPE: rotate L * H_kv heads per token in one call.
        k = rope_keys(attn.rotary_emb, positions, k.reshape(n, -1).contiguous())
        return k.view(n, num_layers, attn.num_kv_heads, attn.head_dim), v

    def fused_layout(self, kv_caches: list[torch.Tensor], dtype: torch.dtype) -> str | None:
        """The cache layout when ops.store_context_kv_fused can do k_norm + RoPE +
        store of all layers in one call (same backend and cache spec in every
        layer, table RoPE, unquantized cache in the model dtype), else None."""
        attns = self.attention_layers()
        layouts = {cache_layout(a) for a in attns}
        if len(layouts) != 1 or None in layouts or not is_table_rope(attns[0].rotary_emb):
            return None
        first = kv_caches[0]
        if first.dim() != 4 or self.model.k_norm_weight.dtype != dtype:
            return None
        if any(c.dtype != dtype or c.shape != first.shape or c.stride() != first.stride() for c in kv_caches):
            return None
        return layouts.pop()

    def store(self, target_features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
        """Compute context K/V of `target_features` ([n, L*D]) at `positions`
        and write them into every draft layer's cache at `slot_mapping` (-1
        skips a row; None only computes, for memory profiling).

        Per step this is four native calls: the fc GEMM, ops.rms_norm
        (hidden_norm), the K/V GEMM of all layers, then ops.store_context_kv_fused
        for k_norm, RoPE and the cache stores of all layers."""
        kv = self.project(target_features)
        if slot_mapping is not None:
            fused = self._fused_args(kv)
            if fused is not None:
                caches, layout, eps, cos_sin_cache, is_neox = fused
                key, value = kv.unbind(2)
                ops.store_context_kv_fused(
                    key, value, self.model.k_norm_weight, eps, cos_sin_cache, positions, is_neox, caches,
                    slot_mapping, layout,
                )  # fmt: skip
                return
        keys, values = self.norm_rope(kv, positions)
        if slot_mapping is None:
            return
        for i, attn in enumerate(self.attention_layers()):
            store_layer_kv(attn, keys[:, i], values[:, i], slot_mapping)

    def _fused_args(self, kv: torch.Tensor) -> tuple | None:
        """(caches, layout, k_norm eps, cos_sin_cache, neox) for
        ops.store_context_kv_fused, or None for the unfused path. Decided once
        (the cos/sin table is a constant), again when vLLM re-binds the caches."""
        first = self.attention_layers()[0]
        plan = self._fused_plan
        if plan is None or plan[0] is not first.attn.kv_cache or plan[1] != kv.dtype:
            caches = [a.attn.kv_cache for a in self.attention_layers()]
            layout = self.fused_layout(caches, kv.dtype)
            args = None
            if layout is not None:
                rope = first.rotary_emb
                cos_sin_cache = rope.cos_sin_cache.to(device=kv.device, dtype=kv.dtype)
                args = (caches, layout, first.k_norm.variance_epsilon, cos_sin_cache, rope.is_neox_style)
            plan = self._fused_plan = (caches[0], kv.dtype, args)
        return plan[2]
