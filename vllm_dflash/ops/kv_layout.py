"""Physical layouts of vLLM's paged KV caches that the context-K/V ops write.

"flash" is FlashAttention's (CUDA); "cpu" is vLLM's CPU attention, whose
packing depends on the ISA vLLM picks for the cache ("cpu_vec" for vec and
vec16, "cpu_amx" for amx). `resolve_kv_layout` restates vLLM's choice (the
register's `_get_attn_isa` mirror); csrc/ops_common.h makes the same choice
for the native kernels.
"""

from __future__ import annotations

import platform

import torch

KV_LAYOUTS = ("cpu", "flash", "cpu_vec", "cpu_amx")


def resolve_kv_layout(layout: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """Map ``"cpu"`` to the packing vLLM 0.32 picks on this machine.

    Mirrors ``_get_attn_isa`` in vllm/v1/attention/backends/cpu_attn.py: head
    sizes that are a multiple of 16 but not of 32 use "vec16", AMX machines use
    "amx" for bf16 with block_size % 32 == 0, other x86 machines "vec"/"vec16".
    vec and vec16 pack blocks the same way ("cpu_vec").
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {KV_LAYOUTS}")
    if layout != "cpu":
        return layout
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(
            f"layout='cpu' is only implemented for x86; vLLM uses another packing on {platform.machine()}"
        )
    if head_size % 32 != 0 and head_size % 16 == 0:
        return "cpu_vec"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "cpu_amx"
    return "cpu_vec"


