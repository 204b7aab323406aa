"""Verifier tests import torch only (no vLLM), so they also run on a bare GPU machine.

The native op comes from the built extension (`pip install --no-build-isolation -e .`).
VLLM_DFLASH_JIT_VERIFIER=1 compiles the CPU ops (csrc/*.cpp, csrc/cpu/*.cpp) on
the fly instead, for working on the kernel without rebuilding the package.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_dflash import envs
from vllm_dflash.ops import dispatch

ROOT = Path(__file__).resolve().parents[2]


def _native_available(device_type: str) -> bool:
    return dispatch.has_kernel("rejection_sample", device_type)


def _jit_build() -> None:
    from torch.utils.cpp_extension import load

    build_dir = ROOT / "build" / "jit_verifier"
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in [*ROOT.glob("csrc/*.cpp"), *ROOT.glob("csrc/cpu/*.cpp")]
                     if p.name != "cuda_bindings.cpp")
    load(name="vllm_dflash_verifier_jit", sources=sources, extra_include_paths=[str(ROOT / "csrc")],
         build_directory=str(build_dir), extra_cflags=["-O3", "-fopenmp"], is_python_module=False)
    dispatch.has_kernel.cache_clear()


@pytest.fixture(scope="session")
def native_cpu() -> None:
    """Fails (not skips) when the CPU kernel is missing: it is a core path."""
    if not _native_available("cpu") and envs.VLLM_DFLASH_JIT_VERIFIER:
        _jit_build()
    if not _native_available("cpu"):
        pytest.fail("torch.ops.vllm_dflash.rejection_sample has no CPU kernel: build the extension with "
                    "`pip install --no-build-isolation --no-deps -e .` (or set VLLM_DFLASH_JIT_VERIFIER=1)")
    if not envs.VLLM_DFLASH_NATIVE_OPS:
        pytest.fail("VLLM_DFLASH_NATIVE_OPS=0 is set: the native kernel would not be tested")


@pytest.fixture(scope="session")
def native_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    if not _native_available("cuda"):
        pytest.fail("torch.ops.vllm_dflash.rejection_sample has no CUDA kernel in this build")
