"""Opt-in phase timings of the proposer, for `vllm-dflash bench --profile`.

With VLLM_DFLASH_PROFILE_FILE=path, the proposer's phases are timed by
wrapping the instance's methods (nothing changes when it is unset) and the
cumulative totals are rewritten to `path` after every propose() call as
{"phases": {name: {"calls", "seconds"}}}; the bench reads it around each
measurement. "other" is propose() outside the named phases (input
preparation with `ops.prepare_dflash_inputs`, gathers, bookkeeping).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm_dflash import envs

PROFILE_ENV = "VLLM_DFLASH_PROFILE_FILE"


class PhaseProfile:
    def __init__(self, path: str):
        self.path = path
        self.phases: dict[str, dict[str, float]] = {}

    def add(self, name: str, seconds: float) -> None:
        entry = self.phases.setdefault(name, {"calls": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["seconds"] += seconds

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)
        return wrapper

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"phases": self.phases}, f)
        os.replace(tmp, self.path)


def install(proposer: Any) -> PhaseProfile | None:
    """Wrap the proposer's phases when PROFILE_ENV is set (after load_model)."""
    path = envs.VLLM_DFLASH_PROFILE_FILE
    if not path:
        return None
    prof = PhaseProfile(path)
    model = proposer.model
    model.store_context_kv = prof.timed("context_kv", model.store_context_kv)
    proposer.build_per_group_and_layer_attn_metadata = prof.timed(
        "attn_metadata", proposer.build_per_group_and_layer_attn_metadata)
    model.forward = prof.timed("draft_forward", model.forward)
    proposer._draft_tokens = prof.timed("lm_head_sample", proposer._draft_tokens)
    inner = proposer.propose

    def propose(*args, **kwargs):
        named = sum(v["seconds"] for k, v in prof.phases.items() if k not in ("propose", "other"))
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            total = time.perf_counter() - t0
            prof.add("propose", total)
            inside = sum(v["seconds"] for k, v in prof.phases.items() if k not in ("propose", "other")) - named
            prof.add("other", total - inside)
            prof.flush()

    proposer.propose = propose
    return prof
