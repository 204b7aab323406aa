"""The environment variables of adaptive speculation, read in one place."""

from __future__ import annotations

import os

# Test hook: a forced adaptive schedule ("jump", "pause:FIRST:END"; see
# adaptive.controller.ForcedSchedule) instead of the cost-driven one.
ADAPTIVE_SCHEDULE_ENV = "VLLM_DFLASH_ADAPTIVE_SCHEDULE"
# Folder where workers keep their adaptive-speculation counters (memory-mapped
# files) for the API server's /metrics; the plugin sets it in the frontend
# process while vLLM builds the engine's config, before the engine processes
# start, so they inherit it.
# Not VLLM_-prefixed: vLLM warns about (or, with fail_on_environ_validation,
# refuses) every VLLM_* variable it does not know, and this one is set by the
# plugin itself, not by the user.
STATS_DIR_ENV = "_VLLM_DFLASH_STATS_DIR"


def adaptive_schedule() -> str | None:
    value = os.environ.get(ADAPTIVE_SCHEDULE_ENV, "").strip()
    return value or None


def stats_dir() -> str | None:
    value = os.environ.get(STATS_DIR_ENV, "").strip()
    return value or None


def set_stats_dir(path: str) -> None:
    os.environ[STATS_DIR_ENV] = path


def clear_stats_dir() -> None:
    os.environ.pop(STATS_DIR_ENV, None)
