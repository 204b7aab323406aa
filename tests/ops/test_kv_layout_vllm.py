"""store_context_kv_layer writes the bytes vLLM 0.32's own attention backends write.

- layout="cpu": the same cache bytes as CPUAttentionBackendImpl.do_kv_cache_update
  (cpu_attn.py -> torch.ops._C.cpu_attn_reshape_and_cache) with the ISA vLLM's
  _get_attn_isa picks on this machine, and with each x86 ISA forced.
- layout="flash": the bytes FlashAttentionImpl.do_kv_cache_update addresses
  through its view (kv_cache.transpose(1, 2).split(d, -1)), for every KV cache
  layout vLLM can allocate. reshape_and_cache_flash itself is a CUDA kernel, so
  a torch stand-in with its documented contract writes through that view: a
  pure view test that needs no GPU.

Caches are allocated the way vLLM's runner does (create_kv_cache_views over a
raw int8 buffer).
"""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import cpu_attn, flash_attn
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_dflash import ops

ISA_TO_LAYOUT = {"amx": "cpu_amx", "vec": "cpu_vec", "vec16": "cpu_vec"}


def _vllm_layer_caches(num_layers, num_blocks, num_heads, block_size, head_size, dtype, layout, gen):
    """Per-layer [B, H, N, 2d] views of one random raw buffer, as vLLM's allocate_kv_cache makes them."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_heads, head_size=head_size, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen)
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return raw, views


def _kv(n, num_heads, head_size, dtype, gen):
    kv = torch.randn(n, 2, num_heads, head_size, generator=gen).to(dtype)
    return kv[:, 0], kv[:, 1]  # non-contiguous, as vLLM's qkv split gives


def _slots(n, capacity, gen):
    slots = torch.randperm(capacity, generator=gen)[:n]
    slots[torch.arange(n) % 4 == 1] = -1
    return slots


def _vllm_cpu_write(key, value, kv_cache, slots, isa):
    impl = object.__new__(cpu_attn.CPUAttentionBackendImpl)
    impl.attn_type = AttentionType.DECODER
    impl.kv_cache_dtype = "auto"
    layer = torch.nn.Module()
    layer.isa, layer._k_scale_float, layer._v_scale_float = isa, 1.0, 1.0
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)


def _cpu_case(dtype, block_size, head_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, num_heads = 3, 2
    raw, (cache,) = _vllm_layer_caches(1, num_blocks, num_heads, block_size, head_size, dtype,
                                       KVCacheLayout.LBHNC, gen)
    key, value = _kv(50, num_heads, head_size, dtype, gen)
    slots = _slots(50, num_blocks * block_size, gen)
    return raw, cache, key, value, slots


CPU_SHAPES = [(dtype, bs, d) for dtype in (torch.bfloat16, torch.float16, torch.float32)
              for bs in (32, 64) for d in (64, 80, 128)]


def test_cpu_backend_supports_only_the_block_major_layout():
    """The CPU packings below assume each (block, head) page is one contiguous run."""
    assert cpu_attn.CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)


@pytest.mark.parametrize("dtype, block_size, head_size", CPU_SHAPES)
def test_cpu_layout_matches_vllm_on_this_machine(dtype, block_size, head_size):
    raw, cache, key, value, slots = _cpu_case(dtype, block_size, head_size, seed=block_size + head_size)
    isa = cpu_attn._get_attn_isa(dtype, block_size, head_size, "auto")
    assert ops.resolve_kv_layout("cpu", dtype, block_size, head_size) == ISA_TO_LAYOUT[isa]

    start = raw.clone()
    _vllm_cpu_write(key, value, cache, slots, isa)
    vllm_bytes = raw.clone()
    assert not torch.equal(vllm_bytes, start)
    for write in (ops.store_context_kv_layer, ops.reference.store_context_kv_layer_ref):
        raw[:] = start
        write(key, value, cache, slots, "cpu")
        assert torch.equal(raw, vllm_bytes), write.__name__


X86_ISA_CASES = (
    # vLLM selects the AMX packing for bfloat16 caches only.
    [(isa, dtype) for isa in ("vec", "vec16") for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    + [("amx", torch.bfloat16)]
)


def _isa_missing_here(isa: str) -> str | None:
    """Why vLLM's kernel for `isa` cannot run on this CPU (None: it can)."""
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        return "this CPU has no AMX (cpuinfo flag amx_tile): vLLM's AMX cache kernel cannot run here"
    return None


def _stated_layout_bytes(raw, cache, key, value, slots, isa):
    """The cache bytes after writing key/value at slots, placed element by
    element from the layout as written in ops.store_context_kv_layer's docstring,
    independent of the kernel, the torch reference and vLLM."""
    expected = raw.clone()
    num_blocks, num_heads, block_size, two_d = cache.shape
    d = two_d // 2
    out = cache.new_empty(0).set_(expected.untyped_storage(), cache.storage_offset(), cache.shape, cache.stride())
    page = out.view(num_blocks, num_heads, 2 * block_size * d)  # [K part | V part] per (block, head)
    n = block_size * d
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        for h in range(num_heads):
            for j in range(d):
                if isa == "amx":
                    k_at = ((o // 16) * (d // 2) + j // 2) * 32 + (o % 16) * 2 + j % 2
                    v_at = ((j // 16) * (block_size // 2) + o // 2) * 32 + (j % 16) * 2 + o % 2
                else:  # vec / vec16: K transposed [d, N], V [N, d]
                    k_at, v_at = j * block_size + o, o * d + j
                page[b, h, k_at] = key[row, h, j]
                page[b, h, n + v_at] = value[row, h, j]
    return expected


@pytest.mark.parametrize("isa, dtype", X86_ISA_CASES)
def test_each_x86_isa_packing_matches_the_stated_layout(isa, dtype):
    """Every x86 packing against the layout spelled out element by element:
    runs on every CPU kind, whatever vLLM can run here."""
    raw, cache, key, value, slots = _cpu_case(dtype, 64, 128, seed=7)
    start = raw.clone()
    expected = _stated_layout_bytes(raw, cache, key, value, slots, isa)
    assert not torch.equal(expected, start)
    for write in (ops.store_context_kv_layer, ops.reference.store_context_kv_layer_ref):
        raw[:] = start
        write(key, value, cache, slots, ISA_TO_LAYOUT[isa])
        assert torch.equal(raw, expected), write.__name__


@pytest.mark.parametrize("isa, dtype", X86_ISA_CASES)
def test_each_x86_isa_packing_matches_vllm(isa, dtype):
    """Every x86 packing vLLM's kernels can run on this CPU, against vLLM's own bytes."""
    missing = _isa_missing_here(isa)
    if missing:
        pytest.skip(missing)
    raw, cache, key, value, slots = _cpu_case(dtype, 64, 128, seed=7)
    start = raw.clone()
    _vllm_cpu_write(key, value, cache, slots, isa)
    vllm_bytes = raw.clone()
    for write in (ops.store_context_kv_layer, ops.reference.store_context_kv_layer_ref):
        raw[:] = start
        write(key, value, cache, slots, ISA_TO_LAYOUT[isa])
        assert torch.equal(raw, vllm_bytes), write.__name__


def test_flash_attention_prefers_the_token_major_layout():
    """FlashAttention declares no layout, so vLLM allocates LBNHC ([B, N, H, 2d]) by default."""
    assert flash_attn.FlashAttentionBackend.supported_kv_cache_layouts() is None
    assert get_supported_kv_cache_layouts([flash_attn.FlashAttentionBackend])[0] == KVCacheLayout.LBNHC


def _reshape_and_cache_flash_contract(key, value, key_cache, value_cache, slot_mapping, *args):
    """reshape_and_cache_flash's contract: caches are [B, N, H, d]; slot -> (slot // N, slot % N)."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    n = slot_mapping.shape[0]
    key_cache[slots // block_size, slots % block_size] = key[:n][keep]
    value_cache[slots // block_size, slots % block_size] = value[:n][keep]


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_layout_matches_flash_attn_view(layout, dtype, monkeypatch):
    monkeypatch.setattr(flash_attn, "reshape_and_cache_flash", _reshape_and_cache_flash_contract, raising=False)
    gen = torch.Generator().manual_seed(11)
    num_layers, num_blocks, num_heads, block_size, head_size = 3, 4, 2, 16, 64
    raw, caches = _vllm_layer_caches(num_layers, num_blocks, num_heads, block_size, head_size, dtype, layout, gen)
    key, value = _kv(40, num_heads, head_size, dtype, gen)
    slots = _slots(36, num_blocks * block_size, gen)  # key/value padded past the slot mapping
    impl = object.__new__(flash_attn.FlashAttentionImpl)
    impl.attn_type, impl.head_size, impl.kv_cache_dtype = AttentionType.DECODER, head_size, "auto"
    layer = torch.nn.Module()
    layer._k_scale = layer._v_scale = torch.ones(())

    start = raw.clone()
    impl.do_kv_cache_update(layer, key, value, caches[1], slots)
    vllm_bytes = raw.clone()
    assert not torch.equal(vllm_bytes, start)
    for write in (ops.store_context_kv_layer, ops.reference.store_context_kv_layer_ref):
        raw[:] = start
        write(key, value, caches[1], slots, "flash")
        assert torch.equal(raw, vllm_bytes), write.__name__  # other layers untouched too
