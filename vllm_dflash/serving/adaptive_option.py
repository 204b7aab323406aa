"""`adaptive`: verify only what pays (the default) or always `num_speculative_tokens`.

    speculative_config={"method": "dflash", "adaptive": true | false}

With `adaptive` on, `num_speculative_tokens` is the most a request drafts in
a step; `vllm_dflash.adaptive` decides per step and request how much of it
to draft and verify. `false` drafts and verifies the full length every step
(for comparisons).

vLLM 0.32's `SpeculativeConfig` forbids unknown keys, so patch 4
(`vllm_dflash.patches`) takes `adaptive` out of the dict before vLLM reads
it and records the choice in the draft's `dflash_config` (`ADAPTIVE_FIELD`),
which travels with the VllmConfig to every worker, where the proposer reads
it (`adaptive_enabled`).

Adaptive drafts go to the scheduler as per-request lists of any length.
vLLM's async scheduling (the CUDA default) schedules placeholder drafts of
one fixed length before the drafter has run, so it cannot take them: with
adaptive on, an unset `async_scheduling` becomes False (logged), and an
explicit `async_scheduling=True` is an error naming both settings. (On CPU
vLLM turns async scheduling off anyway.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("vllm.vllm_dflash")

ADAPTIVE_KEY = "adaptive"
ADAPTIVE_FIELD = "vllm_dflash_adaptive"  # in the draft's hf_config.dflash_config
DEFAULT_ADAPTIVE = True


def adaptive_choice(spec: Mapping[str, Any], *, plugin: bool) -> bool | None:
    """Whether a speculative-config dict (underscore keys) asks for adaptive
    speculation; None when the key does not apply (another method, or vLLM's
    in-tree DFlash serving and the key not given)."""
    value = spec.get(ADAPTIVE_KEY)
    method = spec.get("method")
    if value is None:
        return DEFAULT_ADAPTIVE if plugin and method == "dflash" else None
    if method != "dflash":
        raise ValueError(f"speculative_config.adaptive is a vllm-dflash option for method='dflash' "
                         f"(got method={method!r}); remove it")
    if not isinstance(value, bool):
        raise ValueError(f"speculative_config.adaptive={value!r} is not valid; use true or false "
                         f"(default {str(DEFAULT_ADAPTIVE).lower()})")
    if value and not plugin:
        raise ValueError("speculative_config.adaptive=true needs vllm-dflash's DFlash proposer, but "
                         "VLLM_DFLASH_IMPL=vllm serves vLLM's in-tree DFlash (fixed draft length): "
                         "set adaptive to false or unset VLLM_DFLASH_IMPL")
    return value


def scheduling_for_adaptive(async_scheduling: bool | None) -> bool:
    """EngineArgs.async_scheduling to use with adaptive speculation."""
    if async_scheduling:
        raise ValueError("speculative_config.adaptive=true gives each request its own draft length, which "
                         "vLLM's async scheduling (fixed-length placeholder drafts) cannot schedule: pass "
                         "async_scheduling=False (--no-async-scheduling) or set speculative_config.adaptive "
                         "to false")
    if async_scheduling is None:
        logger.info("vllm-dflash adaptive speculation: async scheduling off (drafts have per-request lengths)")
    return False


def without_key(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The dict vLLM may see: `adaptive` (either spelling) removed."""
    return {k: v for k, v in spec.items() if k.replace("-", "_") != ADAPTIVE_KEY}


def mark(draft_hf_config: Any, adaptive: bool) -> None:
    """Record the choice where workers find it: the draft's dflash_config."""
    dflash = getattr(draft_hf_config, "dflash_config", None)
    if not isinstance(dflash, dict):
        dflash = {}
        draft_hf_config.dflash_config = dflash
    dflash[ADAPTIVE_FIELD] = bool(adaptive)


def adaptive_enabled(speculative_config: Any) -> bool:
    """The proposer's side: adaptive unless the config says otherwise."""
    draft = getattr(speculative_config, "draft_model_config", None)
    dflash = getattr(getattr(draft, "hf_config", None), "dflash_config", None)
    if isinstance(dflash, dict) and ADAPTIVE_FIELD in dflash:
        return bool(dflash[ADAPTIVE_FIELD])
    return DEFAULT_ADAPTIVE
