"""The native ops under torch.compile(fullgraph=True) and torch.library.opcheck:
their schemas and fake (meta) implementations must let vLLM's compiled model
graphs contain them without graph breaks."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops


def _inputs(device, n):
    gen = torch.Generator().manual_seed(n)
    hs = [torch.randn(40, 32, generator=gen).to(torch.bfloat16).to(device) for _ in range(3)]
    idx = torch.randperm(40, generator=gen)[:n].to(device)
    kv = torch.randn(n, 2 * 4 * 16, generator=gen).to(torch.bfloat16).to(device)
    key, value = kv.view(n, 2, 4, 16).unbind(1)  # strided views, as from a fused projection
    cache = torch.randn(3, 4, 32, 32, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(96, generator=gen)[:n].to(device)
    slots[1] = -1
    return hs, idx, key, value, cache, slots


def _step(hs, idx, key, value, cache, slots, layout):
    ctx = ops.gather_hidden_states(hs, idx)
    ops.store_context_kv_layer(key, value, cache, slots, layout)
    return ctx


def test_fullgraph_compile_matches_eager(device, bitwise_equal):
    torch._dynamo.reset()
    layout = "flash" if device == "cuda" else "cpu"
    compiled = torch.compile(_step, fullgraph=True, dynamic=True)
    for n in (5, 9):  # a second size reuses the dynamic graph through the fake impls
        hs, idx, key, value, cache, slots = _inputs(device, n)
        cache_eager = cache.clone()
        expected = ops.reference.gather_hidden_states_ref(hs, idx)
        ops.reference.store_context_kv_layer_ref(key, value, cache_eager, slots, layout)

        got = compiled(hs, idx, key, value, cache, slots, layout)

        bitwise_equal(got, expected)
        bitwise_equal(cache, cache_eager)


def test_opcheck_gather_hidden_states(device):
    hs, idx, *_ = _inputs(device, 7)
    torch.library.opcheck(torch.ops.vllm_dflash.gather_hidden_states.default, (hs, idx))
    out = torch.empty(7, 96, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.vllm_dflash.gather_hidden_states_out.default, (hs, idx, out))


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_opcheck_store_context_kv_layer(device, layout):
    if device == "cuda" and layout == "cpu":
        pytest.skip("vLLM's CPU layout exists on CPU only")
    _, _, key, value, cache, slots = _inputs(device, 7)
    torch.library.opcheck(torch.ops.vllm_dflash.store_context_kv_layer.default, (key, value, cache, slots, layout))
