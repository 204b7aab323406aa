"""The register: every vLLM internal the plugin touches, in one place.

Written against vLLM 0.32.0. Each entry (`VllmInternal`) names a symbol, the
process it is used in (frontend / engine / worker / bench), why, how, the
upstream issue or PR where there is one, and when it can go. Kinds:

- patch: replaced or wrapped in vLLM's own module or class by `apply_all()`
  (called from `vllm_dflash.register()` in every vLLM process);
- override: a vLLM method our subclass overrides, which vLLM must still call;
- call: a vLLM function or method we call, with the parameters we pass;
- read: attributes of a vLLM object we read or set (private ones included);
- wrap: an instance method wrapped for timing (bench, profiler);
- mirror: a vLLM rule our code restates (cache layouts, ISA choice, rope).

`python -m vllm_dflash.patches` prints the register as a table.
`tests/unit/test_vllm_drift.py` checks every entry against the installed
vLLM (name, parameters, callers, restated source), so an upgrade fails there.

Adding an entry: put it in the module of its area (`serving`, `verifier`,
`model_runner`, `adaptive`, `vllm_fixes`; a new area gets a new module with an `ENTRIES` list, added to
`AREAS` below). A patch is an entry with kind="patch" and an `install`
function that is idempotent (`internal.wrap_once` marks what it wraps).

Left out on purpose: vLLM's public API used as documented (LLM,
SamplingParams fields, EngineArgs, layers and loaders that vLLM's own model
files use the same way, e.g. QKVParallelLinear, get_rope, default_weight_loader,
support_torch_compile); torch's own private helpers
(`torch.cpu._is_amx_tile_supported`, named in the _get_attn_isa mirror;
`torch._C._dispatch_has_kernel_for_dispatch_key` in ops.dispatch); tests'
own peeks at engine state (tests/unit/test_vllm_drift.py lists them), which
fail in the tests that make them.
"""

from __future__ import annotations

from vllm_dflash import envs
from vllm_dflash.patches import adaptive, model_runner, serving, verifier, vllm_fixes
from vllm_dflash.patches.internal import KINDS, PROCESSES, VLLM_VERSION, VllmInternal, resolve
from vllm_dflash.patches.model_runner import model_runner_of

AREAS = (serving, verifier, model_runner, adaptive, vllm_fixes)
REGISTER: list[VllmInternal] = [entry for area in AREAS for entry in area.ENTRIES]
PATCHES: list[VllmInternal] = [entry for entry in REGISTER if entry.kind == "patch"]

__all__ = ["KINDS", "PATCHES", "PROCESSES", "REGISTER", "VLLM_VERSION", "VllmInternal", "applied", "apply_all",
           "model_runner_of", "resolve"]

_applied: list[VllmInternal] = []


def applied() -> list[VllmInternal]:
    """Patches installed in this process."""
    return list(_applied)


def apply_all() -> None:
    """Install every patch; safe to call more than once per process.
    VLLM_DFLASH_IMPL=vllm skips the plugin_only ones (vLLM's in-tree DFlash serves)."""
    plugin = envs.use_plugin_impl()
    for patch in PATCHES:
        if patch in _applied or (patch.plugin_only and not plugin):
            continue
        patch.install()
        _applied.append(patch)
