"""The CUDA sources compile without a GPU: `nvcc -c` of csrc/cuda/*.cu for sm_80
and sm_90, and a syntax check of csrc/cuda_bindings.cpp against torch's headers
(scripts/nvcc_check.sh). A missing nvcc fails these tests; set
VLLM_DFLASH_SKIP_NVCC=1 on machines without the CUDA toolkit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from limits import HANG_GUARD_S

from vllm_dflash import envs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "nvcc_check.sh"


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which(os.environ.get("NVCC", "nvcc"))
    if path is None:
        if envs.VLLM_DFLASH_SKIP_NVCC:
            pytest.skip("nvcc not found and VLLM_DFLASH_SKIP_NVCC=1")
        pytest.fail("nvcc not found: install the CUDA toolkit (or set VLLM_DFLASH_SKIP_NVCC=1 to skip)")
    return path


def _run(script: Path, python: str, nvcc: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=python, NVCC=nvcc)
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_cuda_sources_compile(nvcc):
    result = _run(SCRIPT, sys.executable, nvcc)
    assert result.returncode == 0, result.stdout + result.stderr
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    assert sources, "no csrc/cuda/*.cu"
    for src in sources:
        assert f"ok    nvcc sm_80,sm_90  {src}" in result.stdout
    assert "ok    c++ syntax (torch, CUDA headers)  csrc/cuda_bindings.cpp" in result.stdout


def test_check_fails_on_a_broken_source(nvcc, tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / SCRIPT.name)
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "cuda" / "broken.cu").write_text("__global__ void k() { undeclared_name(); }\n")
    result = _run(tmp_path / "scripts" / SCRIPT.name, "false", nvcc)  # PYTHON=false: no torch check
    assert result.returncode != 0
    assert "FAIL  nvcc sm_80,sm_90  csrc/cuda/broken.cu" in result.stdout
