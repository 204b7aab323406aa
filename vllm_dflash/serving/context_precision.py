"""The context K/V projection in float32 where this machine's reduced-precision GEMM is slower.

Every engine step writes the context K/V of its newly verified tokens,
whether it drafts or not (adaptive speculation may not draft for long
stretches): fc, hidden_norm and the K/V GEMM of all draft layers. On a CPU
without a native bf16/fp16 GEMM (AVX2 only) those GEMMs are emulated and run
several times slower than float32 ones (5-6x at 16-64 rows on this
project's AMD EPYC), so in a bf16 engine that write alone could cost more
than a step can afford. Which precision is faster is measured once on the
running machine (`choose_faster`, at the first context write, on that many
rows): on CPUs with AMX or AVX512-BF16, and on GPUs, the model's own dtype
wins and nothing changes. In float32 the K/V are computed from float32
copies of the weights and cast to the cache dtype: more precise, not less.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vllm_dflash import ops


def project_fp32(features: torch.Tensor, fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 kv_weight: torch.Tensor, kv_bias: torch.Tensor | None) -> torch.Tensor:
    """fc -> RMSNorm -> K/V GEMM of [n, F] context features in float32 (weights given in float32)."""
    context = torch.nn.functional.linear(features.float(), fc_weight)
    context = ops.rms_norm(context, norm_weight, eps)
    return torch.nn.functional.linear(context, kv_weight, kv_bias)


def choose_faster(candidates: dict[str, Callable[[], object]], repeats: int = 3) -> str:
    """Name of the candidate with the smallest median wall time over `repeats` calls
    (after one untimed call each, so first-call costs are left out)."""
    times = {}
    for name, fn in candidates.items():
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = sorted(samples)[len(samples) // 2]
    return min(times, key=times.get)
