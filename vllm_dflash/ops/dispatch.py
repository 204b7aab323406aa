"""The one dispatch policy of the seven ops: native kernel or pure-torch reference.

An op runs natively when the library is built, VLLM_DFLASH_NATIVE_OPS is not
0 (read at each call, so a debugging switch takes effect at once) and the
library has a kernel for the tensors' device type (a CPU-only build on a CUDA
tensor takes the reference). Under torch.compile the decision is taken once
at trace time (`assume_constant_result`), so compiled graphs hold the native
op without a graph break.
"""

from __future__ import annotations

import functools

import torch

from vllm_dflash import envs
from vllm_dflash.ops import native  # noqa: F401  (loads the library first)

# Every op of torch.ops.vllm_dflash (gather_hidden_states_out is the out= form
# of gather_hidden_states and follows its decision).
OPS = (
    "gather_hidden_states",
    "store_context_kv_layer",
    "store_context_kv_fused",
    "rms_norm",
    "logits_top2",
    "prepare_dflash_inputs",
    "rejection_sample",
)


@functools.cache
def has_kernel(op: str, device_type: str) -> bool:
    """True when torch.ops.vllm_dflash.<op> has a kernel for this device type."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a vllm_dflash op; use one of {OPS}")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_dflash::{op}", device_type.upper())
    except RuntimeError:  # the library is not loaded (vllm_dflash.ops.native says why)
        return False


@torch.compiler.assume_constant_result
def use_native(op: str, device_type: str) -> bool:
    """Whether `op` on tensors of `device_type` ("cpu", "cuda") runs natively."""
    return envs.VLLM_DFLASH_NATIVE_OPS and has_kernel(op, device_type)
