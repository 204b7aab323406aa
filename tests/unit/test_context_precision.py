"""The float32 context K/V projection and the online choice of precision."""

from __future__ import annotations

import time

import torch

from vllm_dflash import ops
from vllm_dflash.serving import context_precision


def test_float32_projection_matches_the_float64_math_better_than_bf16():
    g = torch.Generator().manual_seed(0)
    n, f, d, kv = 32, 512, 256, 512
    x = torch.randn(n, f, generator=g).bfloat16()
    fc, norm, kvw = torch.randn(d, f, generator=g) / f**0.5, torch.rand(d, generator=g) + 0.5, torch.randn(kv, d, generator=g) / d**0.5
    bias = torch.randn(kv, generator=g)
    ref = x.double() @ fc.double().T
    ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
    ref = ref @ kvw.double().T + bias.double()
    ours = context_precision.project_fp32(x, fc, norm, 1e-6, kvw, bias)
    assert ours.dtype == torch.float32
    bf16 = torch.nn.functional.linear(ops.rms_norm(torch.nn.functional.linear(x, fc.bfloat16()), norm.bfloat16(), 1e-6),
                                      kvw.bfloat16(), bias.bfloat16())
    err32, err16 = (ours.double() - ref).abs().max(), (bf16.double() - ref).abs().max()
    assert err32 < 1e-3 and err32 < err16 / 10, (err32, err16)


def test_choose_faster_picks_the_cheaper_candidate():
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.02)

    def fast():
        calls["fast"] += 1

    assert context_precision.choose_faster({"slow": slow, "fast": fast}, repeats=3) == "fast"
    assert calls == {"slow": 4, "fast": 4}  # one untimed call and three timed ones each
