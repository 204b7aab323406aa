"""Engines that take turns: `vllm-dflash bench --interleave`.

On a shared or throttled machine the speed drifts by tens of percent over
minutes, so modes measured one after the other (one engine per mode) compare
machine states as much as modes. With --interleave, every mode's engine is
started at once and they take turns pass by pass (one timed pass over one
category at one concurrency; --repeats passes make a cell): each pass of one
mode is measured within seconds of the same pass of every other mode, and
only one engine runs at a time.

The turn is a number in a file of a folder the engines share: the engine
whose index it holds runs one cell, then passes the turn on. Before the
first turn every engine waits until all are built (building competes for
the CPUs).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

TURN_FILE = "turn"
# Waiting engines poll the turn file. At 2 ms, four idle engines took several percent of a core
# from the one being measured (a 2-core machine); 20 ms adds at most that between cells, untimed.
POLL_S = 0.02


def start(folder: str) -> None:
    """A fresh turn folder whose first turn is engine 0's (called before the engines start)."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    _write(folder, 0)


def _write(folder: str, index: int) -> None:
    tmp = os.path.join(folder, f".{TURN_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(index))
    os.replace(tmp, os.path.join(folder, TURN_FILE))  # readers never see a half-written number


def _read(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, TURN_FILE)) as f:
            text = f.read()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class Turns:
    """Engine `index` of `count` sharing `folder`."""

    def __init__(self, folder: str, index: int, count: int, timeout_s: float):
        if not 0 <= index < count:
            raise ValueError(f"turn index {index} outside 0..{count - 1}")
        self.folder, self.index, self.count, self.timeout_s = folder, index, count, timeout_s

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.index} waited {self.timeout_s:g}s for {what} in {self.folder}")
            time.sleep(POLL_S)

    def ready(self) -> None:
        """This engine is built; wait until every engine is."""
        open(os.path.join(self.folder, f"ready-{self.index}"), "w").close()
        self._wait(lambda: all(os.path.exists(os.path.join(self.folder, f"ready-{i}")) for i in range(self.count)),
                   "every engine to be built")

    @contextmanager
    def turn(self):
        """Run the body in this engine's turn, then hand the turn to the next engine."""
        self._wait(lambda: _read(self.folder) == self.index, "its turn")
        try:
            yield
        finally:
            _write(self.folder, (self.index + 1) % self.count)
