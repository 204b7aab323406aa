"""Native ops of vllm-dflash (``torch.ops.vllm_dflash.*``) with torch fallbacks.

Two copies sit on the DFlash hot path every step:

- ``gather_hidden_states``: target hidden states of the captured layers ->
  the draft's ``fc`` input ``[n, L*D]``;
- ``write_context_kv``: the draft's context K/V -> vLLM's paged KV cache,
  in the physical layout of the attention backend that will read it.

``HAS_NATIVE`` says whether ``vllm_dflash._C`` loaded. Without it (or with
``VLLM_DFLASH_NATIVE_OPS=0`` in the environment, read once at import; a
debugging switch) the pure-torch references below are used; they give
bit-identical results. This module must not import vLLM.
"""

from __future__ import annotations

import logging
import os
import platform

import torch

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

USE_NATIVE = HAS_NATIVE and os.environ.get("VLLM_DFLASH_NATIVE_OPS", "1") != "0"

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
