"""Which dtype to compute in: bf16 only where the device computes it natively.

A CPU without AMX or AVX512_BF16 emulates bf16 matrix products, 8-20x slower than
float32, so a bf16 default there makes training, feature extraction and response
generation 20x slower than they need to be. `resolve("auto", device)` decides from
torch's own capability checks (CUDA: `is_bf16_supported`; x86 CPUs: AMX /
AVX512_BF16 via `torch.cpu`) and, on other CPUs, from a short timed probe of both
dtypes; the answer carries the reason, which the commands print.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

CHOICES = ("auto", "bf16", "fp32")
X86 = ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True)
class Precision:
    """The compute dtype picked for a device and why."""

    name: str      # "bf16" | "fp32"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def _cpu_flags() -> tuple[bool, bool]:
    """(AMX, AVX512_BF16) as torch's cpuinfo reports them."""
    return bool(torch.cpu._is_amx_tile_supported()), bool(torch.cpu._is_avx512_bf16_supported())


def _seconds_per_matmul(dtype: torch.dtype, device: torch.device, size: int = 384, budget: float = 0.4) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b   # warm up (allocations, kernel selection)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        a @ b
        n += 1
    return (time.perf_counter() - start) / n


def probe_bf16(device: torch.device) -> tuple[bool, str]:
    """Time one matrix product in bf16 and in fp32 (about a second): native bf16 is not slower."""
    bf16 = _seconds_per_matmul(torch.bfloat16, device)
    fp32 = _seconds_per_matmul(torch.float32, device)
    ratio = bf16 / fp32
    verdict = "native" if ratio <= 1.0 else "emulated"
    return ratio <= 1.0, f"probe: a bf16 matmul takes {ratio:.2f}x the fp32 time on this {device.type} ({verdict})"


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and the evidence."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return True, f"CUDA device {name} computes bf16"
        return False, f"CUDA device {name} has no bf16 support"
    if device.type == "cpu" and platform.machine().lower() in X86:
        amx, avx512_bf16 = _cpu_flags()
        if amx:
            return True, "CPU has AMX tiles (native bf16 matrix products)"
        if avx512_bf16:
            return True, "CPU has AVX512_BF16"
        return False, "CPU has neither AMX nor AVX512_BF16: bf16 matrix products would be emulated"
    return probe_bf16(device)


def resolve(choice: str, device: torch.device | str) -> Precision:
    """`auto` -> bf16 where native else fp32; `bf16` / `fp32` as asked (the reason says if it is slow)."""
    if choice not in CHOICES:
        raise ValueError(f"autocast={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "fp32":
        return Precision("fp32", "asked for")
    native, why = native_bf16(device)
    if choice == "bf16":
        return Precision("bf16", "asked for" + ("" if native else f"; slow here: {why}"))
    return Precision("bf16" if native else "fp32", why)


def model_dtype(stored: torch.dtype, precision: Precision) -> torch.dtype:
    """The dtype to run a checkpoint stored in `stored` at: half precision only where native."""
    if stored in (torch.bfloat16, torch.float16) and not precision.bf16:
        return torch.float32
    return stored
