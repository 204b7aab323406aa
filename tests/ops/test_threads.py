"""Every native CPU op gives the same bytes with one thread and with several:
the suite runs with one torch thread (tests/conftest.py), machines run with
however many cores they have, and at::parallel_for splits the work by both."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops
from vllm_dflash.ops import dispatch
from vllm_dflash.verifier import rejection_sample

THREADS = (1, 4)


def _gen():
    return torch.Generator().manual_seed(0)


def _gather():
    g = _gen()
    hs = [torch.randn(512, 256, generator=g).to(torch.bfloat16) for _ in range(3)]
    return ops.gather_hidden_states(hs, torch.randperm(512, generator=g)[:300])


def _kv(n, layers=None, heads=2, d=64, dtype=torch.bfloat16):
    g = _gen()
    shape = (n, heads, d) if layers is None else (n, layers, heads, d)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _slots(n, capacity):
    slots = torch.randperm(capacity, generator=_gen())[:n]
    slots[::7] = -1
    return slots


def _store_layer():
    key, value = _kv(256)
    cache = torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16)
    ops.store_context_kv_layer(key, value, cache, _slots(256, 16 * 32), "cpu")
    return cache


def _store_fused():
    key, value = _kv(256, layers=3)
    caches = [torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16) for _ in range(3)]
    weight = (torch.rand(3, 64, generator=_gen()) + 0.5).to(torch.bfloat16)
    cos_sin = torch.randn(1024, 64, generator=_gen())
    positions = torch.randint(0, 1024, (256,), generator=_gen())
    ops.store_context_kv_fused(key, value, weight, 1e-6, cos_sin, positions, True, caches,
                               _slots(256, 16 * 32), "cpu")
    return torch.stack(caches)


def _rms_norm():
    g = _gen()
    x = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    return ops.rms_norm(x, (torch.rand(256, generator=g) + 0.5).to(torch.bfloat16), 1e-6)


def _logits_top2():
    x = torch.randn(240, 8192, generator=_gen()).to(torch.bfloat16)
    ids, margin = ops.logits_top2(x)
    return torch.cat([ids.double(), margin.double()])


def _prepare_inputs():
    batch, q = 32, 8
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q
    rejected = torch.randint(0, q, (batch,), generator=_gen())
    positions = torch.arange(batch * q) + 100
    slots = torch.arange(batch * q)
    table = torch.arange(batch * 64, dtype=torch.int32).view(batch, 64)
    out = ops.prepare_dflash_inputs(qsl, rejected, positions, slots, torch.arange(batch), table, 16, 9, 7,
                                    batch * q, True)
    return torch.cat([t.double().flatten() for t in out])


def _rejection_sample():
    g = _gen()
    batch, k, vocab = 64, 7, 1000
    drafts = torch.randint(0, vocab, (batch * k,), generator=g)
    cu = torch.arange(1, batch + 1, dtype=torch.int32) * k
    target = torch.randn(batch * (k + 1), vocab, generator=g).softmax(-1)
    q = torch.randn(batch * k, vocab, generator=g).softmax(-1)
    greedy = torch.arange(batch) % 3 == 0
    uniforms = torch.rand(batch * k, generator=g, dtype=torch.float64)
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    return rejection_sample(drafts, cu, target, q, None, greedy, uniforms, noise, k, impl="native")


CASES = {
    "gather_hidden_states": _gather,
    "store_context_kv_layer": _store_layer,
    "store_context_kv_fused": _store_fused,
    "rms_norm": _rms_norm,
    "logits_top2": _logits_top2,
    "prepare_dflash_inputs": _prepare_inputs,
    "rejection_sample": _rejection_sample,
}


def test_every_op_is_covered():
    assert set(CASES) == set(dispatch.OPS)


@pytest.mark.parametrize("op", sorted(CASES))
def test_results_do_not_depend_on_the_thread_count(op, bitwise_equal):
    before = torch.get_num_threads()
    try:
        results = []
        for threads in THREADS:
            torch.set_num_threads(threads)
            results.append(CASES[op]())
    finally:
        torch.set_num_threads(before)
    bitwise_equal(results[1], results[0])
