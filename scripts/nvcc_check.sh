#!/usr/bin/env bash
# Compile-check the CUDA sources without a GPU:
#   1. `nvcc -c` every csrc/cuda/*.cu for sm_80 and sm_90 (-std=c++17);
#   2. when torch is importable, syntax-check the C++ compiled only in CUDA
#      builds (csrc/cuda_bindings.cpp, VLLM_DFLASH_WITH_CUDA sections) against
#      torch's headers (a CPU torch lacks c10/cuda/impl/cuda_cmake_macros.h;
#      a one-line stub stands in for it).
# Exits non-zero on any failure; 127 when nvcc is missing.
# Env: NVCC (default: nvcc on PATH), PYTHON (default: python3), CXX (default: g++).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
PYTHON=${PYTHON:-python3}
CXX=${CXX:-g++}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "nvcc_check: '$NVCC' not found; install the CUDA toolkit or set NVCC" >&2
  exit 127
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

shopt -s nullglob
sources=(csrc/cuda/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
  echo "nvcc_check: no csrc/cuda/*.cu found" >&2
  exit 1
fi

fail=0
for src in "${sources[@]}"; do
  obj="$tmp/$(basename "$src").o"
  if "$NVCC" -c -std=c++17 -O3 -Icsrc \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      "$src" -o "$obj"; then
    echo "ok    nvcc sm_80,sm_90  $src"
  else
    echo "FAIL  nvcc sm_80,sm_90  $src"
    fail=1
  fi
done

# The torch-side CUDA binding is plain C++ against c10/cuda headers.
if torch_inc=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null); then
  cuda_bin=$("$NVCC" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n1)
  cuda_inc="${CUDA_HOME:-${cuda_bin%/bin}}/include"
  stub_inc="$tmp/stub"
  if [ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    mkdir -p "$stub_inc/c10/cuda/impl"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$stub_inc/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  # cuda_bindings.cpp and every C++ file with a VLLM_DFLASH_WITH_CUDA section.
  cpp_sources=(csrc/cuda_bindings.cpp $(grep -l VLLM_DFLASH_WITH_CUDA csrc/*.cpp csrc/cpu/*.cpp 2>/dev/null | grep -v '^csrc/cuda_bindings.cpp$' || true))
  for src in "${cpp_sources[@]}"; do
    [ -f "$src" ] || continue
    if "$CXX" -std=c++20 -fsyntax-only -DVLLM_DFLASH_WITH_CUDA=1 -I"$stub_inc" -I"$torch_inc" \
        -I"$torch_inc/torch/csrc/api/include" -I"$cuda_inc" -Icsrc "$src"; then
      echo "ok    c++ syntax (torch, CUDA headers)  $src"
    else
      echo "FAIL  c++ syntax (torch, CUDA headers)  $src"
      fail=1
    fi
  done
else
  echo "skip  C++ CUDA bindings (torch not importable with $PYTHON)"
fi
exit $fail
