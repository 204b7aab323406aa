"""The controller's decisions as JSON lines (VLLM_DFLASH_ADAPTIVE_TRACE).

The bench's counters say how often an engine drafted; they cannot say why. A
decision depends on the path the engine took (which explorations fell early,
what each batch size measured first), so a cell that went wrong is rarely
reproduced by a second engine: the engine that went wrong has to say it.
One line per replan and per step of another reason than "optimal"; replans are
every 16-64 decisions and steady runs skip planning, so the file stays small.
"""

from __future__ import annotations

import json
import os
import time


class PlanTrace:
    """Appends each record (a dict from `BudgetController.plan`) to `path`, stamped with wall time and
    the process id (engines of several bench rounds may share one file)."""

    def __init__(self, path: str):
        """Opens `path` now (OSError here, where the engine is built, not in a serving step)."""
        self.path = path
        self._file = open(path, "a", buffering=1)  # line-buffered: readable while the engine runs

    def __call__(self, record: dict) -> None:
        self._file.write(json.dumps({"time": round(time.time(), 4), "pid": os.getpid(), **record}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
