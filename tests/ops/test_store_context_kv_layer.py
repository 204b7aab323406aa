"""store_context_kv_layer: native CPU/CUDA kernels against the torch reference, bit for bit.

That the layouts are vLLM's own is proven against vLLM in tests/ops/test_kv_layout_vllm.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (device, layout): vLLM's CPU packings exist on CPU only.
CASES = [(d, "flash") for d in DEVICES] + [("cpu", "cpu"), ("cpu", "cpu_vec"), ("cpu", "cpu_amx")]


def _cache(num_blocks, num_heads, block_size, head_size, dtype, device, gen, token_major=False):
    """A random cache, logically [B, H, N, 2d]; token_major stores it [B, N, H, 2d] (vLLM's LBNHC)."""
    shape = (num_blocks, block_size, num_heads, 2 * head_size) if token_major else (
        num_blocks, num_heads, block_size, 2 * head_size)
    cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    return cache.transpose(1, 2) if token_major else cache


def _qkv_views(n, num_heads, head_size, dtype, device, gen):
    """key/value as the strided views a fused qkv projection produces."""
    q_heads = 2 * num_heads
    qkv = torch.randn(n, (q_heads + 2 * num_heads) * head_size, generator=gen).to(dtype).to(device)
    _, k, v = qkv.split([q_heads * head_size, num_heads * head_size, num_heads * head_size], dim=-1)
    return k.view(n, num_heads, head_size), v.view(n, num_heads, head_size)


def _slots(n, capacity, gen):
    """Distinct random slots, every fifth one (from the third) -1 as vLLM pads."""
    slots = torch.randperm(capacity, generator=gen)[:n]
    slots[torch.arange(n) % 5 == 2] = -1
    return slots


def _run_both(key, value, cache, slots, layout):
    native, ref = cache.clone(), cache.clone()
    ops.store_context_kv_layer(key, value, native, slots, layout)
    ops.reference.store_context_kv_layer_ref(key, value, ref, slots, layout)
    return native, ref


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "device, layout, dtype",
    # vLLM packs AMX blocks for 16-bit caches only.
    [(d, l, t) for d, l in CASES for t in DTYPES if not (l == "cpu_amx" and t == torch.float32)],
)
def test_matches_reference_on_random_shapes(device, layout, dtype, seed, bitwise_equal):
    gen = torch.Generator().manual_seed(seed)
    num_heads = [1, 2, 4, 8][seed % 4]
    head_size = [64, 80, 128][seed % 3]
    block_size = [32, 64][seed % 2] if layout in ("cpu", "cpu_amx") else [16, 32, 64][seed % 3]
    num_blocks = int(torch.randint(1, 6, (1,), generator=gen))
    n = int(torch.randint(1, num_blocks * block_size + 1, (1,), generator=gen))
    key, value = _qkv_views(n + 3, num_heads, head_size, dtype, device, gen)  # 3 padding rows
    slots = _slots(n, num_blocks * block_size, gen).to(device)
    cache = _cache(num_blocks, num_heads, block_size, head_size, dtype, device, gen)

    native, ref = _run_both(key, value, cache, slots, layout)

    bitwise_equal(native, ref)
    assert not torch.equal(native, cache)  # slot 0 of the mapping is always written


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_layout_reads_back_through_flash_attn_view(device, dtype, bitwise_equal):
    """flash_attn.py reads kv_cache.transpose(1, 2).split(d, -1); both cache strides vLLM uses."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_heads, block_size, head_size = 3, 4, 16, 64
    key, value = _qkv_views(40, num_heads, head_size, dtype, device, gen)
    slots = _slots(40, num_blocks * block_size, gen).to(device)
    for token_major in (False, True):
        cache = _cache(num_blocks, num_heads, block_size, head_size, dtype, device, gen, token_major)
        native, ref = _run_both(key, value, cache, slots, "flash")
        bitwise_equal(native, ref)
        k_cache, v_cache = native.transpose(1, 2).split(head_size, dim=-1)  # [B, N, H, d]
        keep = slots >= 0
        blk, off = slots[keep] // block_size, slots[keep] % block_size
        bitwise_equal(k_cache[blk, off], key[keep])
        bitwise_equal(v_cache[blk, off], value[keep])


def test_flash_layout_in_block_outermost_multi_layer_buffer(device, bitwise_equal):
    """One layer's view of a [B, L, N, H, 2d] buffer (vLLM's BLNHC): other layers stay untouched."""
    gen = torch.Generator().manual_seed(2)
    num_blocks, num_layers, num_heads, block_size, head_size = 4, 3, 2, 16, 32
    buf = torch.randn(num_blocks, num_layers, block_size, num_heads, 2 * head_size, generator=gen)
    buf = buf.to(torch.bfloat16).to(device)
    layer = buf[:, 1].transpose(1, 2)  # logical [B, H, N, 2d]
    key, value = _qkv_views(30, num_heads, head_size, torch.bfloat16, device, gen)
    slots = _slots(30, num_blocks * block_size, gen).to(device)
    before = buf.clone()

    ref = layer.clone()
    ops.reference.store_context_kv_layer_ref(key, value, ref, slots, "flash")
    ops.store_context_kv_layer(key, value, layer, slots, "flash")

    bitwise_equal(layer, ref)
    bitwise_equal(buf[:, 0], before[:, 0])
    bitwise_equal(buf[:, 2], before[:, 2])


@pytest.mark.parametrize("device, layout", CASES)
def test_empty_and_all_skipped_slots_leave_cache_untouched(device, layout, bitwise_equal):
    gen = torch.Generator().manual_seed(3)
    cache = _cache(2, 2, 32, 64, torch.bfloat16, device, gen)
    key, value = _qkv_views(4, 2, 64, torch.bfloat16, device, gen)
    for slots in (torch.empty(0, dtype=torch.int64), torch.full((4,), -1)):
        out = cache.clone()
        ops.store_context_kv_layer(key, value, out, slots.to(device), layout)
        bitwise_equal(out, cache)


@pytest.mark.parametrize(
    "dtype, block_size, head_size",
    [(torch.bfloat16, 32, 128), (torch.bfloat16, 64, 64), (torch.float32, 32, 128),
     (torch.float16, 32, 128), (torch.bfloat16, 32, 80), (torch.bfloat16, 16, 64)],
)
def test_cpu_layout_resolves_like_the_reference(dtype, block_size, head_size, bitwise_equal):
    """The C++ CPUID check and torch.cpu._is_amx_tile_supported() pick the same packing."""
    gen = torch.Generator().manual_seed(4)
    cache = _cache(2, 2, block_size, head_size, dtype, "cpu", gen)
    key, value = _qkv_views(20, 2, head_size, dtype, "cpu", gen)
    slots = _slots(20, 2 * block_size, gen)
    resolved = ops.resolve_kv_layout("cpu", dtype, block_size, head_size)
    auto, explicit = cache.clone(), cache.clone()
    ops.store_context_kv_layer(key, value, auto, slots, "cpu")
    ops.store_context_kv_layer(key, value, explicit, slots, resolved)
    bitwise_equal(auto, explicit)
    if resolved == "cpu_amx":  # the two packings differ, so the choice is visible
        vec = cache.clone()
        ops.store_context_kv_layer(key, value, vec, slots, "cpu_vec")
        assert not torch.equal(vec, auto)


def _error_cases(device):
    gen = torch.Generator().manual_seed(5)
    cache = _cache(2, 2, 32, 64, torch.bfloat16, device, gen)
    key, value = _qkv_views(4, 2, 64, torch.bfloat16, device, gen)
    slots = torch.tensor([0, 5, -1, 63], device=device)
    layout = "flash"
    cases = [
        ("fp8", (key, value, torch.zeros(2, 2, 32, 128, dtype=torch.float8_e4m3fn, device=device), slots, layout)),
        ("fp8", (key, value, torch.zeros(2, 2, 32, 128, dtype=torch.uint8, device=device), slots, layout)),
        ("cast", (key.float(), value.float(), cache, slots, layout)),
        ("does not fit key", (key, value, cache[..., :64], slots, layout)),
        ("does not fit key", (key[:, :1], value[:, :1], cache, slots, layout)),
        ("int64", (key, value, cache, slots.int(), layout)),
        ("at most|only 4 rows", (key, value, cache, torch.zeros(5, dtype=torch.int64, device=device), layout)),
        ("unknown|is unknown", (key, value, cache, slots, "paged")),
    ]
    if device == "cpu":
        cases.append(("outside the cache", (key, value, cache, torch.tensor([0, 64, -1, 1]), layout)))
    else:
        cases.append(("CPU attention layout", (key, value, cache, slots, "cpu_vec")))
    return cases


@pytest.mark.parametrize("impl", ["native", "ref"])
def test_bad_inputs_raise_value_error(device, impl):
    write = ops.store_context_kv_layer if impl == "native" else ops.reference.store_context_kv_layer_ref
    for match, args in _error_cases(device):
        with pytest.raises(ValueError, match=match):
            write(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_out_of_cache_slot_fails_the_cuda_kernel(cuda_script):
    result = cuda_script(
        "import torch\n"
        "from vllm_dflash import ops\n"
        "cache = torch.zeros(2, 2, 16, 64, device='cuda')\n"
        "k = torch.randn(3, 2, 32, device='cuda')\n"
        "try:\n"
        "    ops.store_context_kv_layer(k, k, cache, torch.tensor([0, 32, 1], device='cuda'), 'flash')\n"
        "    torch.cuda.synchronize()\n"
        "except RuntimeError as e:\n"
        "    print('CUDA_ERROR', e)\n"
        "    raise SystemExit(3)\n"
        "print('NO_ERROR')\n"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3 and "CUDA_ERROR" in output, output
    assert "vllm_dflash.store_context_kv_layer" in output, output
