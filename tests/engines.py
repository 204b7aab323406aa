"""The one engine factory of the engine tests.

`vllm_engine(**llm_kwargs)` builds a vLLM `LLM` whose engine core and worker
run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set for the engine's
lifetime only), so a test reaches its runner, drafter and samplers through
`vllm_dflash.patches.model_runner_of`; `in_process=False` gives vLLM's
default, an engine-core process with its workers; `env` holds variables set
for the engine's lifetime (e.g. a forced adaptive schedule). On exit the engine is shut
down and vLLM's process state is reset (its environment cache, distributed
state), so the next engine of the module, or of the next module, starts
clean. Engines start in ~25 s or more: a module shares one engine (a
module-scoped fixture) wherever its tests can.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest

DEFAULTS = {
    # vLLM's CPU worker compares this share with the free memory of its NUMA node.
    "gpu_memory_utilization": 0.5,
}


@contextlib.contextmanager
def vllm_engine(*, in_process: bool = True, env: dict[str, str] | None = None, **llm_kwargs: Any) -> Iterator[Any]:
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()  # a previous engine the caller still referenced is garbage by now
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        llm = LLM(**{**DEFAULTS, **llm_kwargs})
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
