"""The one profiler: wall time of engine steps and of the proposer, in named phases.

One set of phase names, used by `vllm-dflash bench` (step split and
`--profile`), by VLLM_DFLASH_PROFILE_FILE and by scripts/profile_propose.py:

- engine step (wrapped on the model runner): `step` (execute_model +
  sample_tokens: a whole step), `target` (the target forward), `draft`
  (propose_draft_token_ids), `verify` (the sampler and the rejection sampler);
  the bench reports them as `<phase>_s` and the step count as `steps`;
- proposer (wrapped on the drafter and its model, for the plugin's proposer
  and vLLM's in-tree one alike): `inputs` (input preparation), `context_kv`
  (target features -> context K/V in the draft's paged cache),
  `attn_metadata` (vLLM's attention-metadata builder), `draft_forward` (the
  query-block forward), `sample` (LM head and draft tokens); `propose` is the
  whole call and `other` the part of it outside the named phases.

Timing wraps instance attributes (nothing changes for other instances) and
never imports vLLM; the vLLM methods wrapped are entries of the register
(vllm_dflash.patches). Nested calls of one phase count once.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from vllm_dflash import envs

STEP_PHASES = ("step", "target", "draft", "verify")
PROPOSE_PHASES = ("inputs", "context_kv", "attn_metadata", "draft_forward", "sample")
PROPOSE_TOTAL, PROPOSE_OTHER = "propose", "other"
STEPS = "steps"  # engine steps (execute_model calls)
PROFILE_ENV = "VLLM_DFLASH_PROFILE_FILE"  # read through vllm_dflash.envs; set by the bench for a mode's process

# Per proposer implementation: phase -> callables to wrap. "drafter.NAME" /
# "model.NAME": attributes of the proposer / its draft model; "call:model":
# the draft model's __call__; "module:MODULE:ATTR.ATTR": looked up through a
# module's globals at call time. Names that do not exist are skipped.
PROPOSER_HOOKS: dict[str, dict[str, list[str]]] = {
    "plugin": {
        "inputs": ["module:vllm_dflash.serving.proposer:ops.prepare_dflash_inputs"],
        "context_kv": ["module:vllm_dflash.serving.proposer:ops.gather_hidden_states", "model.store_context_kv"],
        "attn_metadata": ["drafter.build_per_group_and_layer_attn_metadata"],
        "draft_forward": ["call:model"],
        "sample": ["drafter._draft_tokens"],
    },
    "vllm": {  # vLLM's in-tree DFlash (register: the profiler's wrap entries)
        "inputs": ["drafter.set_inputs_first_pass"],
        "context_kv": ["model.combine_hidden_states", "model.precompute_and_store_context_kv"],
        "attn_metadata": ["drafter.build_per_group_and_layer_attn_metadata"],
        "draft_forward": ["call:model"],
        "sample": ["drafter._sample_draft_tokens"],
    },
}


# Adaptive steps that verified nothing and draft nothing end in the proposer's
# propose_unverified_step, before propose(): they count as steps (execute_model),
# not as propose() calls; their held-back context is timed in the drafting step
# that writes it ("context_kv").


class PhaseTimer:
    """Cumulative {phase: {"calls", "seconds"}}; `sync` (e.g. torch.cuda.synchronize)
    runs around every timed call. With `record_calls`, every propose() call
    also leaves {"batch", "propose", <phase seconds>...} in `calls_log`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 record_calls: bool = False):
        self.clock, self.sync = clock, sync
        self.phases: dict[str, dict[str, float]] = {}
        self.calls_log: list[dict] | None = [] if record_calls else None
        self._active: set[str] = set()
        self._current: dict[str, float] = {}

    def reset(self) -> None:
        self.phases.clear()
        self._current.clear()
        if self.calls_log is not None:
            self.calls_log.clear()

    def add(self, phase: str, seconds: float, calls: int = 1) -> None:
        entry = self.phases.setdefault(phase, {"calls": 0, "seconds": 0.0})
        entry["calls"] += calls
        entry["seconds"] += seconds
        self._current[phase] = self._current.get(phase, 0.0) + seconds

    def count(self, phase: str) -> None:
        self.add(phase, 0.0)

    def wrap(self, fn: Callable, phase: str, count: bool = True) -> Callable:
        """fn, timed into `phase` (count=False: seconds only, no call count)."""
        active = self._active

        def timed(*args, **kwargs):
            if phase in active:
                return fn(*args, **kwargs)
            active.add(phase)
            if self.sync:
                self.sync()
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    self.sync()
                self.add(phase, self.clock() - t0, calls=1 if count else 0)
                active.discard(phase)

        return timed

    def seconds(self, phase: str) -> float:
        return self.phases.get(phase, {}).get("seconds", 0.0)

    def calls(self, phase: str) -> int:
        return int(self.phases.get(phase, {}).get("calls", 0))

    def snapshot(self) -> dict[str, dict[str, float]]:
        return copy.deepcopy(self.phases)

    def write(self, path: str) -> None:
        """{"phases": ...} to `path`, atomically (readers never see half a file)."""
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"phases": self.phases}, f)
        os.replace(tmp, path)


def delta(before: dict | None, after: dict | None) -> dict | None:
    """Phase-wise difference of two snapshots ({phase: {"calls", "seconds"}})."""
    if not after:
        return None
    before = before or {}
    out = {}
    for name, cur in after.items():
        old = before.get(name, {})
        out[name] = {"calls": int(cur.get("calls", 0)) - int(old.get("calls", 0)),
                     "seconds": float(cur.get("seconds", 0.0)) - float(old.get("seconds", 0.0))}
    return out


# ------------------------------------------------------------- engine steps --


def time_engine_steps(model_runner: Any, timer: PhaseTimer) -> None:
    """Wrap the model runner's step parts into STEP_PHASES (and count STEPS)."""
    execute_model = timer.wrap(model_runner.execute_model, "step", count=False)

    def counted(*args, **kwargs):
        timer.count(STEPS)
        return execute_model(*args, **kwargs)

    model_runner.execute_model = counted
    model_runner.sample_tokens = timer.wrap(model_runner.sample_tokens, "step", count=False)
    model_runner.propose_draft_token_ids = timer.wrap(model_runner.propose_draft_token_ids, "draft")
    if hasattr(model_runner, "_model_forward"):
        model_runner._model_forward = timer.wrap(model_runner._model_forward, "target")
    for name in ("sampler", "rejection_sampler"):  # the rejection sampler calls the sampler: counted once
        module = getattr(model_runner, name, None)
        if module is not None and hasattr(module, "forward"):
            module.forward = timer.wrap(module.forward, "verify")


def step_split(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """The bench's per-measurement figures: <phase>_s seconds and the step count."""
    out = {f"{p}_s": float(phases.get(p, {}).get("seconds", 0.0)) for p in STEP_PHASES}
    out[STEPS] = int(phases.get(STEPS, {}).get("calls", 0))
    return out


# ------------------------------------------------------------------ proposer --


def proposer_kind(drafter: Any) -> str:
    """"plugin" for vllm-dflash's proposer, "vllm" for any other (vLLM's in-tree one)."""
    return "plugin" if type(drafter).__module__.startswith("vllm_dflash.") else "vllm"


def time_proposer(drafter: Any, timer: PhaseTimer, hooks: dict[str, list[str]] | None = None) -> list[str]:
    """Wrap the drafter's phases (PROPOSER_HOOKS of its kind by default) and
    propose() itself (PROPOSE_TOTAL, PROPOSE_OTHER); returns the wrapped paths."""
    hooks = PROPOSER_HOOKS[proposer_kind(drafter)] if hooks is None else hooks
    model = drafter.model
    wrapped = []
    for phase, paths in hooks.items():
        for path in paths:
            if path == "call:model":  # nn.Module.__call__ via a subclass: isinstance checks still hold
                cls = type(model)
                model.__class__ = type(f"Timed{cls.__name__}", (cls,), {"__call__": timer.wrap(cls.__call__, phase)})
                wrapped.append(path)
                continue
            if path.startswith("module:"):
                module, attrs = path[len("module:"):].split(":")
                *chain, name = attrs.split(".")
                owner = importlib.import_module(module)
                for attr in chain:
                    owner = getattr(owner, attr, None)
            else:
                head, name = path.split(".", 1)
                owner = {"drafter": drafter, "model": model}[head]
            if owner is None or not hasattr(owner, name):
                continue
            setattr(owner, name, timer.wrap(getattr(owner, name), phase))
            wrapped.append(path)
    named = tuple(hooks)
    propose = drafter.propose

    def timed_propose(*args, **kwargs):
        timer._current = {}
        t0 = timer.clock()
        try:
            return propose(*args, **kwargs)
        finally:
            total = timer.clock() - t0
            inside = sum(timer._current.get(p, 0.0) for p in named)
            timer.add(PROPOSE_TOTAL, total)
            timer.add(PROPOSE_OTHER, total - inside)
            if timer.calls_log is not None:
                batch = kwargs["next_token_ids"].shape[0] if "next_token_ids" in kwargs else None
                timer.calls_log.append({"batch": batch, PROPOSE_TOTAL: total,
                                        **{p: timer._current.get(p, 0.0) for p in named}})

    drafter.propose = timed_propose
    return wrapped


def install_from_env(drafter: Any) -> PhaseTimer | None:
    """With VLLM_DFLASH_PROFILE_FILE set, time the drafter's phases and rewrite
    the file after every propose() call (`vllm-dflash bench --profile` reads it
    around each measurement). Called by the proposer after load_model."""
    path = envs.VLLM_DFLASH_PROFILE_FILE
    if not path:
        return None
    timer = PhaseTimer()
    time_proposer(drafter, timer)
    propose = drafter.propose

    def propose_and_write(*args, **kwargs):
        try:
            return propose(*args, **kwargs)
        finally:
            timer.write(path)

    drafter.propose = propose_and_write
    return timer
