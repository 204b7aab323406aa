"""Every VLLM_DFLASH_* environment variable (and the plugin's own
_VLLM_DFLASH_STATS_DIR), read here and nowhere else.

`envs.NAME` reads the variable when it is accessed (nothing is cached), so a
test's monkeypatch.setenv or a bench mode's environment takes effect at once,
and a bad value fails with a ValueError naming the variable and the fix.
This module imports nothing but the standard library: the plugin entry
point, the engine process, the worker, setup.py (build-time switches, loaded
by path) and the tests all read it. To add a variable: one entry in
`environment_variables` (reader + the line that documents it) and one line in
the TYPE_CHECKING block.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_DFLASH_IMPL: str
    VLLM_DFLASH_VERIFIER: str | None
    VLLM_DFLASH_NATIVE_OPS: bool
    VLLM_DFLASH_PROFILE_FILE: str | None
    VLLM_DFLASH_REGISTER_MARKER_DIR: str | None
    VLLM_DFLASH_CUDA: bool
    VLLM_DFLASH_BUILD_BACKEND: str | None
    VLLM_DFLASH_JIT_VERIFIER: bool
    VLLM_DFLASH_SKIP_NVCC: bool
    VLLM_DFLASH_ADAPTIVE_SCHEDULE: str | None
    VLLM_DFLASH_ADAPTIVE_TRACE: str | None
    VLLM_DFLASH_GEMM_ROWS: bool
    _VLLM_DFLASH_STATS_DIR: str | None

IMPL_CHOICES = ("plugin", "vllm")
VERIFIER_CHOICES = ("dflash", "vllm")
BUILD_BACKENDS = ("cmake", "torch")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _impl() -> str:
    impl = _raw("VLLM_DFLASH_IMPL").lower() or "plugin"
    if impl not in IMPL_CHOICES:
        raise ValueError(f"VLLM_DFLASH_IMPL={impl!r} is not valid; use 'plugin' (default) or 'vllm'")
    return impl


def _verifier() -> str | None:
    choice = _raw("VLLM_DFLASH_VERIFIER").lower()
    if choice and choice not in VERIFIER_CHOICES:
        raise ValueError(f"VLLM_DFLASH_VERIFIER={choice!r} is not valid; use one of {VERIFIER_CHOICES} or unset it")
    return choice or None


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        value = _raw(name)
        if value == "":
            return default
        if value not in ("0", "1"):
            raise ValueError(f"{name}={value!r} is not valid; use 1 or 0 (default {int(default)})")
        return value == "1"

    return read


def _path(name: str) -> Callable[[], str | None]:
    return lambda: _raw(name) or None


def _build_backend() -> str | None:
    backend = _raw("VLLM_DFLASH_BUILD_BACKEND") or None
    if backend is not None and backend not in BUILD_BACKENDS:
        raise ValueError(f"VLLM_DFLASH_BUILD_BACKEND={backend!r}: use 'cmake' or 'torch'")
    return backend


def _adaptive_schedule() -> str | None:
    value = _raw("VLLM_DFLASH_ADAPTIVE_SCHEDULE") or None
    parts = (value or "").split(":")
    if value is not None and value != "jump" and not (
            len(parts) == 3 and parts[0] == "pause" and parts[1].isdigit() and parts[2].isdigit()):
        raise ValueError(f"VLLM_DFLASH_ADAPTIVE_SCHEDULE={value!r} is not valid; use 'jump' or "
                         "'pause:FIRST:END' (step numbers), or unset it for the cost-driven schedule")
    return value


environment_variables: dict[str, Callable[[], Any]] = {
    # Serving.
    # Which DFlash serves method="dflash": "plugin" (default), or "vllm" for vLLM's
    # in-tree DFlash (comparisons); read in the engine process and every worker.
    "VLLM_DFLASH_IMPL": _impl,
    # Which rejection sampler verifies DFlash: "dflash" (ours) or "vllm"; unset,
    # ours serves whenever the plugin's DFlash does.
    "VLLM_DFLASH_VERIFIER": _verifier,
    # 0 replaces every native op (vllm_dflash.ops) by its pure-torch reference
    # (debugging); read at each op call.
    "VLLM_DFLASH_NATIVE_OPS": _flag("VLLM_DFLASH_NATIVE_OPS", True),
    # A JSON file the proposer rewrites with its phase timings after every step
    # (`vllm-dflash bench --profile`); unset, nothing is timed.
    "VLLM_DFLASH_PROFILE_FILE": _path("VLLM_DFLASH_PROFILE_FILE"),
    # Tests: a forced adaptive schedule ("jump", "pause:FIRST:END"; see
    # adaptive.controller.ForcedSchedule) instead of the cost-driven one; read
    # when the proposer is built.
    "VLLM_DFLASH_ADAPTIVE_SCHEDULE": _adaptive_schedule,
    # A file the adaptive controller appends one JSON line to per replan and per
    # step of another reason than "optimal" (its q, reason, plan values, arms):
    # why an engine drafted where it did. Rank r > 0 writes FILE.rank<r>. Read
    # when the proposer is built; unset, nothing is written.
    "VLLM_DFLASH_ADAPTIVE_TRACE": _path("VLLM_DFLASH_ADAPTIVE_TRACE"),
    # 0 turns off the row-count grid of CPU GEMMs (serving.gemm_rows: padded
    # target passes, query blocks and context writes, kernels made at load);
    # for comparisons. Read when the proposer loads.
    "VLLM_DFLASH_GEMM_ROWS": _flag("VLLM_DFLASH_GEMM_ROWS", True),
    # Set by the plugin, not by users: the folder where workers keep their
    # adaptive-speculation counters (memory-mapped files) for the API server's
    # /metrics, set in the frontend process while vLLM builds the engine's
    # config so the engine processes inherit it. Not VLLM_-prefixed: vLLM warns
    # about (or, with fail_on_environ_validation, refuses) every VLLM_* variable
    # it does not know.
    "_VLLM_DFLASH_STATS_DIR": _path("_VLLM_DFLASH_STATS_DIR"),
    # Tests: register() leaves a file here per process it runs in.
    "VLLM_DFLASH_REGISTER_MARKER_DIR": _path("VLLM_DFLASH_REGISTER_MARKER_DIR"),
    # Build (setup.py).
    # 0 builds the CPU kernels only, even with a CUDA build of torch.
    "VLLM_DFLASH_CUDA": _flag("VLLM_DFLASH_CUDA", True),
    # "cmake" (default when cmake is installed) or "torch" (torch.utils.cpp_extension).
    "VLLM_DFLASH_BUILD_BACKEND": _build_backend,
    # Tests.
    # 1 compiles csrc/cpu/rejection_sample.cpp on the fly for the verifier tests
    # when the installed extension lacks the op (kernel work without rebuilding).
    "VLLM_DFLASH_JIT_VERIFIER": _flag("VLLM_DFLASH_JIT_VERIFIER", False),
    # 1 skips the nvcc compile check on machines without the CUDA toolkit.
    "VLLM_DFLASH_SKIP_NVCC": _flag("VLLM_DFLASH_SKIP_NVCC", False),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def use_plugin_impl() -> bool:
    """False when VLLM_DFLASH_IMPL=vllm asks for vLLM's in-tree DFlash."""
    return _impl() == "plugin"


ADAPTIVE_SCHEDULE_ENV = "VLLM_DFLASH_ADAPTIVE_SCHEDULE"


def adaptive_schedule() -> str | None:
    return environment_variables[ADAPTIVE_SCHEDULE_ENV]()


STATS_DIR_ENV = "_VLLM_DFLASH_STATS_DIR"


def stats_dir() -> str | None:
    return environment_variables[STATS_DIR_ENV]()


def set_stats_dir(path: str) -> None:
    os.environ[STATS_DIR_ENV] = path


def clear_stats_dir() -> None:
    os.environ.pop(STATS_DIR_ENV, None)
