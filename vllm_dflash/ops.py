"""Native ops of vllm-dflash (``torch.ops.vllm_dflash.*``) with torch fallbacks.

On the DFlash hot path every step:

- ``prepare_dflash_inputs``: the runner's batch -> context rows/positions/
  slots and the query block's ids, positions, slots and lengths;
- ``gather_hidden_states``: target hidden states of the captured layers ->
  the draft's ``fc`` input ``[n, L*D]``;
- ``rms_norm``: the draft's ``hidden_norm`` of the context features;
- ``context_kv_write``: projected context K/V of every draft layer -> k_norm,
  RoPE and vLLM's paged KV caches in one pass;
- ``write_context_kv``: context K/V -> one layer's paged KV cache, in the
  physical layout of the attention backend that will read it.

``HAS_NATIVE`` says whether ``vllm_dflash._C`` loaded. Without it (or with
``VLLM_DFLASH_NATIVE_OPS=0`` in the environment, read once at import; a
debugging switch) the pure-torch references below are used; they give
bit-identical results (context_kv_write: within rounding, see its docstring). This module must not import vLLM.
"""

from __future__ import annotations

import logging
import platform
from typing import NamedTuple

import torch

from vllm_dflash import envs

logger = logging.getLogger("vllm_dflash")

HAS_NATIVE = False
try:
    from vllm_dflash import _C  # noqa: F401  (registers torch.ops.vllm_dflash.*)

    HAS_NATIVE = True
except ImportError as e:  # pragma: no cover - exercised only without a build
    logger.warning(
        "vllm_dflash._C is not built (%s); using the slower pure-torch ops. "
        "Build it with `pip install --no-build-isolation --no-deps -e .`.",
        e,
    )

USE_NATIVE = HAS_NATIVE and envs.VLLM_DFLASH_NATIVE_OPS

KV_LAYOUTS = ("cpu", "flash", "cpu_vec", "cpu_amx")


# --------------------------------------------------------------------------
# gather_hidden_states
# --------------------------------------------------------------------------


def gather_hidden_states_ref(
    hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``gather_hidden_states``; bounds are checked on CPU only (a
    check on CUDA would need a device sync)."""
    if len(hidden_states) == 0:
        raise ValueError("hidden_states is empty; pass one [T, D] tensor per captured layer")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int32/int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    num_rows = hidden_states[0].shape[0]
    if indices.device.type == "cpu" and indices.numel() > 0:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"gather_hidden_states: index {bad} is out of range for hidden_states with "
                f"{num_rows} rows; indices must lie in [0, {num_rows})"
            )
    result = torch.cat([h.index_select(0, indices) for h in hidden_states], dim=-1)
    if out is None:
        return result
    out.copy_(result)
    return out


def gather_hidden_states(
    hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``i`` of the result is ``cat([h[indices[i]] for h in hidden_states])``.

    hidden_states: L tensors ``[T, D]``, one dtype and device; row-strided views
    (e.g. slices of a larger buffer) are read in place. indices: int32/int64
    ``[n]`` in ``[0, T)``. Returns a contiguous ``[n, L*D]`` tensor, written into
    ``out`` when given (e.g. a persistent CUDA-graph buffer). An out-of-range
    index raises ValueError on CPU; on CUDA it traps the kernel with a printed
    message (no host sync on the hot path).
    """
    if not USE_NATIVE:
        return gather_hidden_states_ref(hidden_states, indices, out)
    hidden_states = list(hidden_states)
    if out is None:
        return torch.ops.vllm_dflash.gather_hidden_states(hidden_states, indices)
    torch.ops.vllm_dflash.gather_hidden_states_out(hidden_states, indices, out)
    return out


# --------------------------------------------------------------------------
# write_context_kv
# --------------------------------------------------------------------------


def resolve_kv_layout(layout: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """Map ``"cpu"`` to the packing vLLM 0.32 picks on this machine.

    Mirrors ``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py: head
    sizes that are a multiple of 16 but not of 32 use "vec16", AMX machines use
    "amx" for bf16 with block_size % 32 == 0, other x86 machines "vec"/"vec16".
    vec and vec16 pack blocks the same way ("cpu_vec").
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {KV_LAYOUTS}")
    if layout != "cpu":
        return layout
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(
            f"layout='cpu' is only implemented for x86; vLLM uses another packing on {platform.machine()}"
        )
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "cpu_vec"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "cpu_amx"
    return "cpu_vec"


def _check_kv_args(key, value, kv_cache, slot_mapping) -> None:
    if kv_cache.element_size() == 1:
        raise ValueError(
            f"kv_cache is {kv_cache.dtype} (an fp8/quantized KV cache); only unquantized caches are "
            "supported, start vLLM with kv_cache_dtype='auto'"
        )
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [n, num_kv_heads, head_size], got {tuple(key.shape)}, {tuple(value.shape)}")
    if kv_cache.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError(f"kv_cache is {kv_cache.dtype} but key/value are {key.dtype}/{value.dtype}; cast to the cache dtype")
    n, num_heads, head_size = key.shape
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_heads or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not fit key {tuple(key.shape)}; "
            f"expected [num_blocks, {num_heads}, block_size, {2 * head_size}]"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.shape[0] > n:
        raise ValueError(f"slot_mapping must be 1-D int64 with at most {n} entries, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def write_context_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str,
) -> None:
    """Pure-torch ``write_context_kv`` (same layouts, same bytes)."""
    _check_kv_args(key, value, kv_cache, slot_mapping)
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    layout = resolve_kv_layout(layout, kv_cache.dtype, block_size, d)
    if layout != "flash" and kv_cache.device.type != "cpu":
        raise ValueError(f"layout={layout!r} is vLLM's CPU attention layout but kv_cache is on {kv_cache.device}")
    n = slot_mapping.shape[0]
    if kv_cache.device.type == "cpu" and n > 0 and int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, outside the cache "
            f"({num_blocks} blocks x {block_size} = {num_blocks * block_size} slots)"
        )
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key, value = key[:n][keep], value[:n][keep]
    blk, off = slots // block_size, slots % block_size
    if layout == "flash":
        kv_cache[blk, :, off, :d] = key
        kv_cache[blk, :, off, d:] = value
        return
    if layout == "cpu_amx" and (kv_cache.element_size() != 2 or block_size % 32 or d % 16):
        raise ValueError("the AMX layout needs a 16-bit cache, block_size % 32 == 0 and head_size % 16 == 0")
    # vLLM's CPU page per (block, head): [K part: N*d elements | V part: N*d elements].
    pages = kv_cache.view(num_blocks, num_heads, 2, block_size * d)
    k_part, v_part = pages[:, :, 0], pages[:, :, 1]
    if layout == "cpu_vec":
        k_part.view(num_blocks, num_heads, d, block_size)[blk, :, :, off] = key
        v_part.view(num_blocks, num_heads, block_size, d)[blk, :, off, :] = value
    else:  # cpu_amx: pairs of 16-bit values share a 32-bit AMX lane
        p = 2
        k_tiles = k_part.view(num_blocks, num_heads, block_size // 16, d // p, 16, p)
        k_tiles[blk, :, off // 16, :, off % 16, :] = key.reshape(-1, num_heads, d // p, p)
        v_tiles = v_part.view(num_blocks, num_heads, d // 16, block_size // p, 16, p)
        v_tiles[blk, :, :, off // p, :, off % p] = value.reshape(-1, num_heads, d // 16, 16)


def write_context_kv(
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
      :func:`resolve_kv_layout` to

      - ``"cpu_vec"`` (ISA "vec"/"vec16"): K part ``[d, block_size]`` (K
        transposed), V part ``[block_size, d]``;
      - ``"cpu_amx"`` (ISA "amx", bf16): K part ``[block_size/16, d/2, 16, 2]``
        with ``K[o, j]`` at ``[o//16, j//2, o%16, j%2]``; V part
        ``[d/16, block_size/2, 16, 2]`` with ``V[o, j]`` at
        ``[j//16, o//2, j%16, o%2]``.

    Other ISAs (ARM neon, PowerPC, s390x, RISC-V) raise ValueError. Out-of-cache
    slots raise ValueError on CPU and trap the kernel on CUDA.
    """
    if not USE_NATIVE:
        write_context_kv_ref(key, value, kv_cache, slot_mapping, layout)
        return
    torch.ops.vllm_dflash.write_context_kv(key, value, kv_cache, slot_mapping, layout)


# --------------------------------------------------------------------------
# context_kv_write: k_norm + RoPE + paged-cache store of every draft layer
# --------------------------------------------------------------------------


def _check_context_kv_args(key, value, k_norm_weight, cos_sin_cache, positions, kv_caches, slot_mapping) -> None:
    if key.dim() != 4 or value.shape != key.shape:
        raise ValueError(
            f"key/value must both be [n, num_layers, num_kv_heads, head_size], got "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    n, num_layers, _, head_size = key.shape
    if len(kv_caches) != num_layers:
        raise ValueError(f"got {len(kv_caches)} kv_caches for {num_layers} layers in key; pass one cache per layer")
    if tuple(k_norm_weight.shape) != (num_layers, head_size) or k_norm_weight.dtype != key.dtype:
        raise ValueError(
            f"k_norm_weight must be [{num_layers}, {head_size}] in {key.dtype}, got "
            f"{k_norm_weight.dtype} {tuple(k_norm_weight.shape)}"
        )
    rot = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if cos_sin_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16) or rot <= 0 or rot % 2 or rot > head_size:
        raise ValueError(
            f"cos_sin_cache must be a float [max_position, rotary_dim] tensor (cat(cos, sin), rotary_dim "
            f"even and <= head_size {head_size}), got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if positions.dim() != 1 or positions.dtype != torch.int64 or positions.shape[0] < slot_mapping.shape[0]:
        raise ValueError(
            f"positions must be 1-D int64 with at least {slot_mapping.shape[0]} entries, got "
            f"{positions.dtype} {tuple(positions.shape)}"
        )
    for i, cache in enumerate(kv_caches[1:], 1):
        if cache.shape != kv_caches[0].shape or cache.stride() != kv_caches[0].stride() or cache.dtype != kv_caches[0].dtype:
            raise ValueError(f"kv_caches[{i}] differs from kv_caches[0]; all draft layers must share one cache spec")
    del n


def rms_norm_rope_ref(
    key: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """Per-head RMSNorm then RoPE of keys ``[n, L, H, d]`` (weight ``[L, d]``),
    with the arithmetic of vLLM's RMSNorm (fp32, rounded to the model dtype
    before the weight) and rotary embedding (fp32 rotation, rounded once)."""
    dtype = key.dtype
    k32 = key.float()
    normed = (k32 * torch.rsqrt(k32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype)
    x = (normed * k_norm_weight[:, None, :]).float()
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float()[:, None, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:rot]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rot:]), dim=-1).to(dtype)


def context_kv_write_ref(
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
    """Pure-torch ``context_kv_write``: :func:`rms_norm_rope_ref`, then
    :func:`write_context_kv_ref` per layer."""
    _check_context_kv_args(key, value, k_norm_weight, cos_sin_cache, positions, kv_caches, slot_mapping)
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    positions = positions[:n][keep]
    if positions.device.type == "cpu" and positions.numel() > 0:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"positions hold {lo if lo < 0 else hi}, outside cos_sin_cache ({cos_sin_cache.shape[0]} positions)"
            )
    keys = rms_norm_rope_ref(key[:n][keep], k_norm_weight, eps, cos_sin_cache, positions, is_neox)
    values, slots = value[:n][keep], slot_mapping[keep]
    for layer, cache in enumerate(kv_caches):
        write_context_kv_ref(keys[:, layer], values[:, layer], cache, slots, layout)


def context_kv_write(
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
    ``[>= n]``. kv_caches: one cache per layer, as :func:`write_context_kv`
    takes them, with ``layout``; slot -1 skips a row (no norm, RoPE or store).

    The math is :func:`rms_norm_rope_ref`'s: float32 results agree with it up
    to the order of the sum of squares (a few ulps), 16-bit ones within one
    unit in the last place.
    """
    if not USE_NATIVE:
        context_kv_write_ref(key, value, k_norm_weight, eps, cos_sin_cache, positions, is_neox, kv_caches, slot_mapping, layout)
        return
    torch.ops.vllm_dflash.context_kv_write(
        key, value, k_norm_weight, float(eps), cos_sin_cache, positions, bool(is_neox), list(kv_caches), slot_mapping, layout
    )


# --------------------------------------------------------------------------
# rms_norm: the context features' hidden_norm in one call
# --------------------------------------------------------------------------


def rms_norm_ref(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's native RMSNorm (vllm/ir/ops/layernorm.py) and transformers'
    Qwen3RMSNorm: fp32 statistics, rounded to the dtype before the weight."""
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1] or weight.dtype != input.dtype:
        raise ValueError(
            f"weight must be [{input.shape[-1]}] in {input.dtype}, got {weight.dtype} {tuple(weight.shape)}"
        )
    x = input.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(weight.dtype) * weight


def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, ``weight`` ``[D]`` in input's dtype; a new
    contiguous tensor. :func:`rms_norm_ref`'s math: float32 agrees up to the
    order of the sum of squares (a few ulps), 16-bit within one unit in the
    last place. One native call where vLLM's RMSNorm module dispatches ~8 torch
    ops outside compiled graphs."""
    if not USE_NATIVE:
        return rms_norm_ref(input, weight, eps)
    return torch.ops.vllm_dflash.rms_norm(input, weight, float(eps))


# --------------------------------------------------------------------------
# prepare_dflash_inputs: one drafting step's inputs in one call
# --------------------------------------------------------------------------


class DFlashStepInputs(NamedTuple):
    """Context rows (target rows that become draft context K/V) and the query
    block ``[bonus, MASK x k]`` of every request, request-major."""

    context_rows: torch.Tensor  # [n] int64 target row of each context entry
    context_positions: torch.Tensor  # [n] int64
    context_slots: torch.Tensor  # [n] int64, -1 = do not write
    input_ids: torch.Tensor  # [B * (k + 1)] int32
    positions: torch.Tensor  # [B * (k + 1)] int64
    slots: torch.Tensor  # [B * (k + 1)] int64
    seq_lens: torch.Tensor  # [B] int32: context before the block + k + 1
    query_start_loc: torch.Tensor  # [B + 1] int32: r * (k + 1)


def prepare_dflash_inputs_ref(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    target_positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    next_token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    num_speculative_tokens: int,
    num_rows: int,
    compact: bool,
) -> DFlashStepInputs:
    """Pure-torch ``prepare_dflash_inputs`` (same outputs, element for element)."""
    batch = next_token_ids.shape[0]
    q_len = num_speculative_tokens + 1
    device = next_token_ids.device
    if block_size <= 0 or num_speculative_tokens < 0 or block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(
            f"block_size={block_size}, num_speculative_tokens={num_speculative_tokens}, block_table "
            f"{tuple(block_table.shape)}: need block_size > 0, k >= 0 and a [>= {batch}, max_blocks] table"
        )
    starts = query_start_loc[: batch + 1].long()
    rows = torch.arange(num_rows, device=device)
    rejected = torch.zeros(batch, dtype=torch.int64, device=device) if num_rejected is None else num_rejected[:batch].long()
    verified_end = torch.maximum(starts[:-1], starts[1:] - rejected)  # [B]
    if num_rejected is None:
        ctx_rows, ctx_slots = rows, slot_mapping[:num_rows].clone()
    else:
        request = torch.searchsorted(starts[1:], rows, right=True).clamp_(max=max(batch - 1, 0))
        verified = (rows < verified_end[request]) & (rows >= starts[0]) if batch else rows < 0
        if compact:
            ctx_rows = verified.nonzero().squeeze(1)
            ctx_slots = slot_mapping[ctx_rows]
        else:
            ctx_rows = rows
            ctx_slots = torch.where(verified, slot_mapping[:num_rows], -1)
    ctx_positions = target_positions[ctx_rows]

    has_verified = verified_end > starts[:-1]
    last = (verified_end - 1).clamp(min=0, max=max(num_rows - 1, 0))
    first = starts[:-1].clamp(max=max(num_rows - 1, 0))
    if num_rows > 0:
        start = torch.where(has_verified, target_positions[last] + 1, torch.where(starts[:-1] < num_rows, target_positions[first], 0))
    else:
        start = torch.zeros(batch, dtype=torch.int64, device=device)
    positions = (start[:, None] + torch.arange(q_len, device=device)).reshape(-1)
    input_ids = torch.full((batch, q_len), mask_token_id, dtype=torch.int32, device=device)
    input_ids[:, 0] = next_token_ids.to(torch.int32)
    block_idx = (positions // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table[:batch].gather(1, block_idx.view(batch, q_len)).view(-1)
    return DFlashStepInputs(
        context_rows=ctx_rows,
        context_positions=ctx_positions,
        context_slots=ctx_slots,
        input_ids=input_ids.view(-1),
        positions=positions,
        slots=blocks.long() * block_size + positions % block_size,
        seq_lens=(start + q_len).to(torch.int32),
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len,
    )


def prepare_dflash_inputs(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    target_positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    next_token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    num_speculative_tokens: int,
    num_rows: int,
    compact: bool,
) -> DFlashStepInputs:
    """Everything one drafting step needs from the runner's batch, in one call.

    The target pass has ``num_rows`` rows, request-major: request r owns rows
    ``[query_start_loc[r], query_start_loc[r+1])``, and in a verification step
    its last ``num_rejected[r]`` rows were rejected (None: a step without
    drafts, every row counts). B = ``len(next_token_ids)``.

    - Context: the verified rows, whose hidden states become draft K/V at
      their own positions and ``slot_mapping`` slots. ``compact=True`` returns
      only them (the count needs the host: CPU only); ``compact=False``
      returns all ``num_rows`` rows in order with slot -1 for rejected and
      padding rows (no host sync). Without num_rejected every row is context.
    - Query block of request r: ids ``[next_token_ids[r], mask_token_id x k]``
      at positions ``p_r .. p_r + k``, p_r = 1 + position of r's last verified
      row (a request without one, whose drafts vLLM discards, starts at its
      first row's position); slots from row r of ``block_table`` (int32,
      block index clamped to its width) with ``block_size``;
      ``seq_lens[r] = p_r + k + 1``, ``query_start_loc[r] = r * (k + 1)``.
    """
    if not USE_NATIVE:
        return prepare_dflash_inputs_ref(
            query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids, block_table,
            block_size, mask_token_id, num_speculative_tokens, num_rows, compact,
        )  # fmt: skip
    return DFlashStepInputs(
        *torch.ops.vllm_dflash.prepare_dflash_inputs(
            query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids, block_table,
            block_size, mask_token_id, num_speculative_tokens, num_rows, compact,
        )  # fmt: skip
    )


# --------------------------------------------------------------------------
# Fake (meta) implementations, so torch.compile / FakeTensor can trace the ops.
# --------------------------------------------------------------------------

if HAS_NATIVE:

    @torch.library.register_fake("vllm_dflash::gather_hidden_states")
    def _gather_hidden_states_fake(hidden_states, indices):
        h0 = hidden_states[0]
        return h0.new_empty((indices.shape[0], len(hidden_states) * h0.shape[1]))

    @torch.library.register_fake("vllm_dflash::gather_hidden_states_out")
    def _gather_hidden_states_out_fake(hidden_states, indices, out):
        return None

    @torch.library.register_fake("vllm_dflash::write_context_kv")
    def _write_context_kv_fake(key, value, kv_cache, slot_mapping, layout):
        return None

    @torch.library.register_fake("vllm_dflash::context_kv_write")
    def _context_kv_write_fake(key, value, k_norm_weight, eps, cos_sin_cache, positions, is_neox, kv_caches,
                               slot_mapping, layout):  # fmt: skip
        return None

    @torch.library.register_fake("vllm_dflash::rms_norm")
    def _rms_norm_fake(input, weight, eps):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @torch.library.register_fake("vllm_dflash::prepare_dflash_inputs")
    def _prepare_dflash_inputs_fake(query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids,
                                    block_table, block_size, mask_token_id, num_speculative_tokens, num_rows,
                                    compact):  # fmt: skip
        batch, q_len = next_token_ids.shape[0], num_speculative_tokens + 1
        n = torch.library.get_ctx().new_dynamic_size() if compact and num_rejected is not None else num_rows
        i64 = dict(dtype=torch.int64, device=next_token_ids.device)
        i32 = dict(dtype=torch.int32, device=next_token_ids.device)
        return (
            torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **i64),
            torch.empty(batch * q_len, **i32), torch.empty(batch * q_len, **i64), torch.empty(batch * q_len, **i64),
            torch.empty(batch, **i32), torch.empty(batch + 1, **i32),
        )  # fmt: skip
