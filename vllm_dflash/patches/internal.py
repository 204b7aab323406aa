"""One entry of the register: a vLLM internal the plugin touches, and how.

Entries are data: `tests/unit/test_vllm_drift.py` checks every one against
the installed vLLM by name, parameters and usage, so that an upgrade which
renames or reshapes an internal fails there, not deep in a serving step, and
an override vLLM stopped calling cannot go unnoticed. The checks never run
in the plugin (the register names modules the plugin must not import, such as
vLLM's in-tree DFlash).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.32.0"

# What the plugin does with the symbol.
KINDS = {
    "patch": "replaced or wrapped in vLLM's own module or class (installed by register())",
    "override": "a vLLM method our subclass overrides; vLLM's code must still call it",
    "implement": "a method vLLM calls on an object of ours in place of its own (same parameters); vLLM must still call it",
    "call": "a vLLM function or method we call, relying on its parameters",
    "read": "attributes of a vLLM object we read or set",
    "wrap": "an instance's method wrapped for timing (bench, profiler)",
    "mirror": "a vLLM rule or behaviour our code restates or relies on; vLLM's source must still state it",
}
# Where the access happens: the process that builds the engine config (LLM,
# `vllm serve`'s API server), the engine core, the model-runner worker, or
# the benchmark / profiler with the engine in its own process.
PROCESSES = ("frontend", "engine", "worker", "bench")

MARK = "__vllm_dflash_patch__"


@dataclass(frozen=True)
class VllmInternal:
    """A vLLM internal the plugin patches, overrides, calls, reads, wraps or mirrors.

    symbol: "module:Qualified.name" (for kind "read": the owner class, with
    the attribute names in `names`). params: the exact parameter names relied
    on (None: not checked). used_by / usage: a vLLM symbol whose source must
    still contain each `usage` string (how vLLM calls an override or a
    patched name). source_has: strings the symbol's own source must contain
    (a mirrored rule). returns: what a `call` of the symbol with no
    arguments returns (a backend name). original: for a patched module
    attribute, vLLM's own object whose parameters `params` describes.
    ours: the plugin's object that overrides, replaces or restates it (an
    override or replacement must take the same parameters).
    """

    symbol: str
    kind: str
    process: tuple[str, ...]
    why: str
    how: str
    remove_when: str
    upstream: str | None = None
    params: tuple[str, ...] | None = None
    names: tuple[str, ...] = ()
    used_by: str | None = None
    usage: tuple[str, ...] = ()
    source_has: tuple[str, ...] = ()
    returns: object = None
    original: str | None = None
    ours: str | None = None
    install: Callable[[], None] | None = None
    plugin_only: bool = True  # patches: skipped with VLLM_DFLASH_IMPL=vllm
    vllm_version: str = VLLM_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"VllmInternal {self.symbol}: kind={self.kind!r}; use one of {sorted(KINDS)}")
        if not self.process or any(p not in PROCESSES for p in self.process):
            raise ValueError(f"VllmInternal {self.symbol}: process={self.process!r}; use some of {PROCESSES}")
        if (self.kind == "patch") != (self.install is not None):
            raise ValueError(f"VllmInternal {self.symbol}: kind 'patch' and install= go together")
        if ":" not in self.symbol:
            raise ValueError(f"VllmInternal symbol {self.symbol!r} must read 'module:Qualified.name'")

    @property
    def module(self) -> str:
        return self.symbol.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.symbol.split(":", 1)[1]


def resolve(symbol: str):
    """The object named "module:Qualified.name" (AttributeError/ImportError when it moved)."""
    module, _, qualname = symbol.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def wrap_once(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace owner.name (a class's method or a module's function) by
    make_wrapper(original), once: the wrapper is marked, so re-runs skip."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, MARK, True)
    setattr(owner, name, wrapper)

