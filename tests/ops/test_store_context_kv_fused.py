"""store_context_kv_fused (k_norm + RoPE + paged-cache store of every draft layer):
native CPU/CUDA kernels against the torch reference, and the reference
against an independent float64 RMSNorm + rotary embedding.

Tolerance: the kernels sum squares in another order than torch, so a K value
may differ from the reference by rounding: float32 within rtol 1e-5 (a few
ulps), float16/bfloat16 within 2 units of the dtype's epsilon of the head's
scale. Most 16-bit values must still match bit for bit (>= 95%), V and every
cache entry outside the written K rows always do.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(d, "flash") for d in DEVICES] + [("cpu", "cpu"), ("cpu", "cpu_vec"), ("cpu", "cpu_amx")]
EPS = 1e-6


def rope_cache(rot_dim: int, max_pos: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM's RotaryEmbedding.cos_sin_cache: [max_pos, rot_dim] = cat(cos, sin)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def make_inputs(n, num_layers, num_heads, head_size, dtype, device, gen, extra_rows=2):
    """key/value as views of one fused [n', L * 2 * H * d] projection ([n', L, 2, H, d])."""
    kv = (torch.randn(n + extra_rows, num_layers * 2 * num_heads * head_size, generator=gen) * 3).to(dtype).to(device)
    kv = kv.view(n + extra_rows, num_layers, 2, num_heads, head_size)
    weight = (1 + 0.5 * torch.randn(num_layers, head_size, generator=gen)).to(dtype).to(device)
    return kv[:, :, 0], kv[:, :, 1], weight


def caches(num_layers, num_blocks, num_heads, block_size, head_size, dtype, device, gen):
    return [
        torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype).to(device)
        for _ in range(num_layers)
    ]


def k_mask(key, value, cache, slots, layout):
    """True where store_context_kv_layer puts K elements of the written rows."""
    mask = torch.zeros_like(cache)
    ops.reference.store_context_kv_layer_ref(torch.ones_like(key), torch.zeros_like(value), mask, slots, layout)
    return mask.bool()


def assert_close_kv(native, ref, mask, dtype):
    """Bitwise equal outside `mask` (V, untouched slots); K within the stated tolerance."""
    n32, r32 = native.float(), ref.float()
    outside = ~mask
    assert torch.equal(native[outside], ref[outside]), "V or untouched cache entries differ"
    a, b = n32[mask], r32[mask]
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    eps = torch.finfo(dtype).eps
    scale = b.abs().max().clamp(min=1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=float(2 * eps * scale))
    exact = (native[mask] == ref[mask]).float().mean().item()
    assert exact >= 0.95, f"only {exact:.1%} of 16-bit K values match the reference bit for bit"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "device, layout, dtype",
    [(d, l, t) for d, l in CASES for t in DTYPES if not (l == "cpu_amx" and t == torch.float32)],
)
def test_matches_reference(device, layout, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_layers = [1, 2, 3, 5][seed]
    num_heads = [1, 2, 4, 8][seed]
    head_size = [64, 128, 32, 64][seed] if layout != "cpu_vec" else [64, 80, 32, 128][seed]
    rot_dim = head_size if seed % 2 == 0 else head_size // 2  # partial rotary: the rest passes through
    is_neox = seed != 1
    block_size = 32 if layout in ("cpu", "cpu_amx") else [16, 32][seed % 2]
    num_blocks = 4
    n = int(torch.randint(1, num_blocks * block_size, (1,), generator=gen))
    key, value, weight = make_inputs(n, num_layers, num_heads, head_size, dtype, device, gen)
    cos_sin = rope_cache(rot_dim, 4096).to(dtype if seed % 2 else torch.float32).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.arange(n) % 4 == 1] = -1
    positions = torch.randint(0, 4096, (n + 2,), generator=gen)
    slots, positions = slots.to(device), positions.to(device)
    base = caches(num_layers, num_blocks, num_heads, block_size, head_size, dtype, device, gen)
    native, ref = [c.clone() for c in base], [c.clone() for c in base]

    ops.store_context_kv_fused(key, value, weight, EPS, cos_sin, positions, is_neox, native, slots, layout)
    ops.reference.store_context_kv_fused_ref(key, value, weight, EPS, cos_sin, positions, is_neox, ref, slots, layout)

    for layer in range(num_layers):
        mask = k_mask(key[:, layer], value[:, layer], base[layer], slots, layout)
        assert_close_kv(native[layer], ref[layer], mask, dtype)
        assert not torch.equal(native[layer], base[layer])


def _independent_norm_rope(x, weight, eps, positions, rot_dim, is_neox, base=10000.0):
    """float64 RMSNorm * weight, then RoPE written from the RoFormer/HF formula."""
    x = x.double()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()[:, None, :]
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angle = positions.double()[:, None] * inv_freq  # [n, rot/2]
    cos, sin = angle.cos()[:, None, None, :], angle.sin()[:, None, None, :]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:  # rotate_half: (x1, x2) -> (-x2, x1) with halves
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # pairs (2i, 2i+1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_reference_is_rms_norm_then_rope(is_neox, rot_dim):
    """The reference (and so the kernels) computes k_norm then RoPE with vLLM's
    cos_sin_cache layout: float32 agrees with a float64 formula to 1e-5
    (positions < 64: a float32 cache's angles drift by ~pos * 2**-24 rad)."""
    gen = torch.Generator().manual_seed(3)
    key, _, weight = make_inputs(9, 2, 2, 64, torch.float32, "cpu", gen, extra_rows=0)
    positions = torch.randint(0, 64, (9,), generator=gen)
    got = ops.reference.rms_norm_rope_ref(key, weight, EPS, rope_cache(rot_dim, 2048), positions, is_neox)
    want = _independent_norm_rope(key, weight, EPS, positions, rot_dim, is_neox)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_native_fp32_matches_float64_formula():
    gen = torch.Generator().manual_seed(4)
    key, value, weight = make_inputs(6, 2, 2, 64, torch.float32, "cpu", gen, extra_rows=0)
    positions = torch.randint(0, 64, (6,), generator=gen)
    cache = [torch.zeros(1, 2, 16, 128) for _ in range(2)]
    slots = torch.arange(6)
    ops.store_context_kv_fused(key, value, weight, EPS, rope_cache(64, 1024), positions, True, cache, slots, "flash")
    want = _independent_norm_rope(key, weight, EPS, positions, 64, True)
    for layer in range(2):
        got_k = cache[layer][0, :, :6, :64].transpose(0, 1)  # [n, H, d]
        torch.testing.assert_close(got_k.double(), want[:, layer], rtol=1e-5, atol=1e-5)
        assert torch.equal(cache[layer][0, :, :6, 64:].transpose(0, 1), value[:, layer])


def test_skipped_rows_are_not_read(device):
    """Slot -1 rows do nothing: not even their (out-of-range) positions are used."""
    gen = torch.Generator().manual_seed(5)
    key, value, weight = make_inputs(4, 2, 2, 32, torch.bfloat16, device, gen)
    cache = caches(2, 2, 2, 16, 32, torch.bfloat16, device, gen)
    before = [c.clone() for c in cache]
    slots = torch.full((4,), -1, dtype=torch.int64, device=device)
    positions = torch.full((4,), 10**6, dtype=torch.int64, device=device)
    ops.store_context_kv_fused(key, value, weight, EPS, rope_cache(32, 64).to(device), positions, True, cache, slots, "flash")
    assert all(torch.equal(a, b) for a, b in zip(cache, before))


def test_empty_input(device):
    gen = torch.Generator().manual_seed(6)
    key, value, weight = make_inputs(0, 2, 2, 32, torch.float16, device, gen)
    cache = caches(2, 2, 2, 16, 32, torch.float16, device, gen)
    before = [c.clone() for c in cache]
    empty = torch.empty(0, dtype=torch.int64, device=device)
    ops.store_context_kv_fused(key, value, weight, EPS, rope_cache(32, 64).to(device), empty, True, cache, empty, "flash")
    assert all(torch.equal(a, b) for a, b in zip(cache, before))


def _bad_call(**change):
    gen = torch.Generator().manual_seed(7)
    key, value, weight = make_inputs(4, 2, 2, 32, torch.float32, "cpu", gen)
    args = dict(
        key=key, value=value, k_norm_weight=weight, eps=EPS, cos_sin_cache=rope_cache(32, 64),
        positions=torch.arange(4), is_neox=True, kv_caches=caches(2, 2, 2, 16, 32, torch.float32, "cpu", gen),
        slot_mapping=torch.tensor([0, 5, -1, 31]), layout="cpu",
    )  # fmt: skip
    args.update(change)
    ops.store_context_kv_fused(**args)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(slot_mapping=torch.tensor([0, 32, -1, 1])), "slot_mapping\\[1\\] = 32 is outside the cache"),
        (dict(positions=torch.tensor([0, 64, 1, 2])), "positions\\[1\\] = 64 is outside cos_sin_cache"),
        (dict(kv_caches=[torch.zeros(2, 2, 16, 64)]), "got 1 kv_caches for 2 layers"),
        (dict(k_norm_weight=torch.ones(2, 16)), "k_norm_weight must be \\[2, 32\\]"),
        (dict(k_norm_weight=torch.ones(2, 32, dtype=torch.bfloat16)), "k_norm_weight is BFloat16"),
        (dict(cos_sin_cache=torch.ones(64, 33)), "cos_sin_cache must be"),
        (dict(positions=torch.arange(4, dtype=torch.int32)), "positions must be 1-D int64"),
        (dict(kv_caches=[torch.zeros(2, 2, 16, 64), torch.zeros(3, 2, 16, 64)]), "kv_caches\\[1\\]"),
        (dict(layout="paged"), "unknown layout 'paged'"),
    ],
)
def test_bad_input_raises_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**change)


def test_opcheck(device):
    gen = torch.Generator().manual_seed(8)
    key, value, weight = make_inputs(5, 2, 2, 32, torch.bfloat16, device, gen)
    cache = caches(2, 2, 2, 16, 32, torch.bfloat16, device, gen)
    slots = torch.tensor([3, -1, 7, 8, 30], device=device)
    args = (key, value, weight, EPS, rope_cache(32, 64).to(device), torch.arange(7, device=device), True, cache, slots,
            "flash")  # fmt: skip
    torch.library.opcheck(torch.ops.vllm_dflash.store_context_kv_fused.default, args)
