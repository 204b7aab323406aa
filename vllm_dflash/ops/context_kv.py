"""Context K/V into vLLM's paged KV caches.

store_context_kv_layer: finished K/V of one layer, at any slots, in the
physical layout of the backend that will read them. store_context_kv_fused:
raw K/V projections of every draft layer -> k_norm, RoPE and the stores of
all layers in one call (the draft model's hot path).
"""

from __future__ import annotations

import torch

from vllm_dflash.ops import dispatch, reference


def store_context_kv_layer(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str,
) -> None:
    """Write context K/V into one layer of vLLM's paged KV cache, in place.

    key, value: ``[n', H, d]`` (any token/head strides), cache dtype; only the
    first ``n = len(slot_mapping)`` rows are written (vLLM pads key/value, not
    the slot mapping). slot_mapping: int64 ``[n]``, slot = block_id *
    block_size + offset with block_size = ``kv_cache.shape[2]`` (the kernel
    block size); negative slots (vLLM's -1 padding) are skipped.
    kv_cache: one layer's tensor as vLLM 0.32 allocates it, logical
    ``[num_blocks, H, block_size, 2*d]``; fp8 caches are refused.

    Layouts (physical placement of token o of block b, head h):

    - ``"flash"`` (FlashAttention on CUDA; any block/head/token strides, as the
      KVCacheLayout in use gives): ``kv_cache[b, h, o, :d] = K``,
      ``kv_cache[b, h, o, d:] = V``; flash_attn.py reads
      ``kv_cache.transpose(1, 2).split(d, -1)``.
    - ``"cpu"`` (vLLM's CPU attention; ``cpu_attn.py`` views a page as
      ``[2*block_size, d]`` and chunks it into a K part and a V part, which
      ``cpu_attn_reshape_and_cache`` packs per ISA): resolved by
      :func:`vllm_dflash.ops.kv_layout.resolve_kv_layout` to

      - ``"cpu_vec"`` (ISA "vec"/"vec16"): K part ``[d, block_size]`` (K
        transposed), V part ``[block_size, d]``;
      - ``"cpu_amx"`` (ISA "amx", bf16): K part ``[block_size/16, d/2, 16, 2]``
        with ``K[o, j]`` at ``[o//16, j//2, o%16, j%2]``; V part
        ``[d/16, block_size/2, 16, 2]`` with ``V[o, j]`` at
        ``[j//16, o//2, j%16, o%2]``.

    Other ISAs (ARM neon, PowerPC, s390x, RISC-V) raise ValueError. Out-of-cache
    slots raise ValueError on CPU and trap the kernel on CUDA.
    """
    if not dispatch.use_native("store_context_kv_layer", key.device.type):
        reference.store_context_kv_layer_ref(key, value, kv_cache, slot_mapping, layout)
        return
    torch.ops.vllm_dflash.store_context_kv_layer(key, value, kv_cache, slot_mapping, layout)


def store_context_kv_fused(
    key: torch.Tensor,
    value: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool,
    kv_caches: list[torch.Tensor] | tuple[torch.Tensor, ...],
    slot_mapping: torch.Tensor,
    layout: str,
) -> None:
    """Context K/V of every draft layer into vLLM's paged caches, in one call.

    key, value: ``[n', L, H, d]`` raw projections (K before k_norm and RoPE;
    any strides with a dense last dim, e.g. views of one fused K/V GEMM);
    only the first ``n = len(slot_mapping)`` rows are used. k_norm_weight:
    ``[L, d]`` in key's dtype, eps: the norm's epsilon. cos_sin_cache: vLLM's
    ``RotaryEmbedding.cos_sin_cache`` ``[max_position, rotary_dim]`` =
    ``cat(cos, sin)``; dims past rotary_dim pass through; ``is_neox`` picks
    the half-split (Qwen3, Llama) or interleaved pairing. positions: int64
    ``[>= n]``. kv_caches: one cache per layer, as :func:`store_context_kv_layer`
    takes them, with ``layout``; slot -1 skips a row (no norm, RoPE or store).

    The math is :func:`reference.rms_norm_rope_ref`'s: float32 results agree with it up
    to the order of the sum of squares (a few ulps), 16-bit ones within one
    unit in the last place.
    """
    if not dispatch.use_native("store_context_kv_fused", key.device.type):
        reference.store_context_kv_fused_ref(key, value, k_norm_weight, eps, cos_sin_cache, positions, is_neox, kv_caches, slot_mapping, layout)
        return
    torch.ops.vllm_dflash.store_context_kv_fused(
        key, value, k_norm_weight, float(eps), cos_sin_cache, positions, bool(is_neox), list(kv_caches), slot_mapping, layout
    )
