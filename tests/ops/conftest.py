"""Native-op tests import torch only (no vLLM), so they also run on a bare GPU
machine. Every test runs on CPU, and on CUDA when a device is present.

The native ops are a core path: a missing build fails the tests, it does not
skip them (build with `pip install --no-build-isolation --no-deps -e .`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from limits import HANG_GUARD_S

from vllm_dflash import envs, ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def native() -> None:
    if not ops.HAS_NATIVE:
        pytest.fail("vllm_dflash._C is not built: run `pip install --no-build-isolation --no-deps -e .`")
    if not envs.VLLM_DFLASH_NATIVE_OPS:
        pytest.fail("VLLM_DFLASH_NATIVE_OPS=0 is set: the native ops would not be tested")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bytes, not just equal values (-0.0 vs 0.0 and NaN payloads count)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    view = _INT_VIEW[actual.element_size()]
    a, e = actual.contiguous().view(view), expected.contiguous().view(view)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{bad.shape[0]} of {a.numel()} elements differ, first at {bad[0].tolist()}")


def run_cuda_script(code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh process: a failed device-side assert poisons the CUDA context."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)


# Helpers as fixtures: test modules here cannot import this conftest by name
# (other test folders have their own conftest.py).
@pytest.fixture
def bitwise_equal():
    return assert_bitwise_equal


@pytest.fixture
def cuda_script():
    return run_cuda_script
