#!/usr/bin/env bash
# One short check for a lent GPU machine (torch with CUDA, no vLLM, no internet),
# run from the repo root; finishes in under 5 minutes:
#   1. build vllm_dflash._C with CUDA in place (CMake; torch.utils.cpp_extension
#      if CMake is missing or fails);
#   2. run tests/ops (every test on cpu and cuda) and the compiled flex-attention training check;
#   3. microbenchmark gather_hidden_states / store_context_kv_layer at Qwen3-8B sizes
#      (D=4096, L=5, H=8, d=128, bf16, n=16..4096), native vs torch reference,
#      each size first checked bit-exact; JSON to $OUT/gpu_check.json if OUT is set.
# Missing pytest/cmake/ninja are installed offline from .whl/gpu_check/ when present
# (carry that folder). Exit status: 0 only if the build, the tests and the benchmark pass.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl/gpu_check}
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-285}))
status=0
phase_times=()

left() { local s=$((DEADLINE - SECONDS)); [ "$s" -gt 5 ] && echo "$s" || echo 5; }
cap() { local want=$1 have; have=$(left); [ "$have" -lt "$want" ] && echo "$have" || echo "$want"; }
log() { echo "[gpu_check $(date +%H:%M:%S) +${SECONDS}s] $*"; }
timed() {  # timed NAME CMD...: run, record seconds, return status
  local name=$1 t0=$SECONDS rc; shift
  "$@"; rc=$?
  phase_times+=("$name=$((SECONDS - t0))s(rc=$rc)")
  return $rc
}

# ---------------------------------------------------------------- environment
log "host: $(hostname), $(nproc) CPUs"
nvidia-smi -L 2>/dev/null || log "nvidia-smi not available"
if ! "$PY" -c 'import torch, sys; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'; then
  log "FATAL: $PY has no CUDA torch"; exit 2
fi
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  [ -x "$d/nvcc" ] && ! command -v nvcc >/dev/null 2>&1 && export PATH="$d:$PATH"
done
if ! command -v nvcc >/dev/null 2>&1; then
  log "FATAL: nvcc not found (no CUDA toolkit): the CUDA extension cannot be built here"; exit 2
fi
nvcc --version | tail -n 2
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}

missing=$("$PY" - <<'EOF'
import importlib.util, shutil, sys, os
need = [m for m in ("pytest",) if importlib.util.find_spec(m) is None]
bindir = os.path.dirname(sys.executable)
need += [t for t in ("cmake", "ninja") if not (shutil.which(t) or os.path.exists(os.path.join(bindir, t)))]
print(" ".join(need))
EOF
)
if [ -n "$missing" ]; then
  if [ -d "$WHEELS" ]; then
    log "installing offline from $WHEELS: $missing"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing \
      || "$PY" -m pip install -q --user --break-system-packages --no-index --find-links "$WHEELS" $missing \
      || log "offline install failed"
  else
    log "missing: $missing (no $WHEELS folder to install from)"
  fi
fi
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$HOME/.local/bin:$PATH"
command -v cmake >/dev/null 2>&1 && cmake --version | head -n 1

# ---------------------------------------------------------------------- build
GPU_ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$GPU_ARCH}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export VLLM_DFLASH_CUDA=1
log "building vllm_dflash._C for sm_${TORCH_CUDA_ARCH_LIST} with $MAX_JOBS jobs"
rm -f vllm_dflash/_C*.so
built=0
if command -v cmake >/dev/null 2>&1; then
  timed build_cmake timeout "$(cap 170)" "$PY" setup.py -q build_ext --inplace && built=1
fi
if [ "$built" = 0 ]; then
  log "CMake build unavailable or failed: building with torch.utils.cpp_extension"
  VLLM_DFLASH_BUILD_BACKEND=torch timed build_torch timeout "$(cap 170)" "$PY" setup.py -q build_ext --inplace && built=1
fi
if [ "$built" = 0 ] || ! "$PY" -c '
import torch, vllm_dflash.ops as ops
assert ops.HAS_NATIVE, "vllm_dflash._C did not load"
for op in ("gather_hidden_states", "gather_hidden_states_out", "store_context_kv_layer"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_dflash::{op}", "CUDA"), f"{op} has no CUDA kernel"
print("native ops loaded with CUDA kernels")'; then
  log "FATAL: build failed"; printf '  %s\n' "${phase_times[@]}"; exit 1
fi

# ---------------------------------------------------------------------- tests
log "running tests/ops (cpu + cuda)"
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  log "FAIL: pytest is not installed (carry .whl/gpu_check)"; status=1
elif ! timed tests timeout "$(cap 150)" "$PY" -m pytest -q -p no:cacheprovider tests/ops tests/training/test_training_masks.py -rs; then
  log "FAIL: tests/ops"; status=1
fi

# ------------------------------------------------------------------ benchmark
log "microbenchmark (Qwen3-8B sizes, bf16)"
timed bench timeout "$(cap 90)" "$PY" - <<'EOF' || { log "FAIL: benchmark"; status=1; }
import json, os, time
import torch
from vllm_dflash import ops

torch.manual_seed(0)
dev, dtype = "cuda", torch.bfloat16
L, D, H, d, block_size = 5, 4096, 8, 128, 16


def bench(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # microseconds


def bitwise(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


rows = []
for n in (16, 64, 256, 1024, 4096):
    T = n + 256  # a padded target batch; gather picks n of its rows
    hs = [torch.randn(T, D, device=dev, dtype=dtype) for _ in range(L)]
    idx = torch.randperm(T, device=dev)[:n]
    out = torch.empty(n, L * D, device=dev, dtype=dtype)
    assert bitwise(ops.gather_hidden_states(hs, idx), ops.reference.gather_hidden_states_ref(hs, idx)), n
    g_native = bench(lambda: ops.gather_hidden_states(hs, idx, out=out))
    g_ref = bench(lambda: ops.reference.gather_hidden_states_ref(hs, idx))

    num_blocks = 2 * (n + block_size - 1) // block_size + 8
    # vLLM's default FlashAttention allocation (LBNHC): physically [B, N, H, 2d].
    cache = torch.randn(num_blocks, block_size, H, 2 * d, device=dev, dtype=dtype).transpose(1, 2)
    kv = torch.randn(n, 2, H, d, device=dev, dtype=dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, device=dev)[:n]
    a, b = cache.clone(), cache.clone()
    ops.store_context_kv_layer(key, value, a, slots, "flash")
    ops.reference.store_context_kv_layer_ref(key, value, b, slots, "flash")
    assert bitwise(a, b), n
    w_native = bench(lambda: ops.store_context_kv_layer(key, value, cache, slots, "flash"))
    w_ref = bench(lambda: ops.reference.store_context_kv_layer_ref(key, value, cache, slots, "flash"))

    g_bytes, w_bytes = 2 * n * L * D * 2, 2 * 2 * n * H * d * 2  # read + write
    rows.append(dict(n=n, gather_native_us=g_native, gather_ref_us=g_ref,
                     gather_native_GBps=g_bytes / g_native / 1e3,
                     write_kv_native_us=w_native, write_kv_ref_us=w_ref,
                     write_kv_native_GBps=w_bytes / w_native / 1e3))

print(f"{'n':>5} | {'gather native':>13} {'ref':>9} {'GB/s':>7} | {'write_kv native':>15} {'ref':>9} {'GB/s':>7}   (us/call)")
for r in rows:
    print(f"{r['n']:>5} | {r['gather_native_us']:>13.1f} {r['gather_ref_us']:>9.1f} {r['gather_native_GBps']:>7.0f} | "
          f"{r['write_kv_native_us']:>15.1f} {r['write_kv_ref_us']:>9.1f} {r['write_kv_native_GBps']:>7.0f}")
result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
              sizes=dict(L=L, D=D, H=H, d=d, block_size=block_size, dtype="bfloat16"), rows=rows)
if os.environ.get("OUT"):
    path = os.path.join(os.environ["OUT"], "gpu_check.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
EOF

log "phases: ${phase_times[*]}"
log "$([ $status = 0 ] && echo PASS || echo FAIL) (total ${SECONDS}s)"
exit $status
