"""Which verifier serves a speculative config: ours or vLLM's.

Read by the worker (DFlashRejectionSampler) and by the engine process (the
min-p check of SamplingParams), so it stays free of vLLM imports.

VLLM_DFLASH_VERIFIER=dflash|vllm forces one verifier for DFlash; unset, ours
serves whenever vllm-dflash's DFlash does (VLLM_DFLASH_IMPL is not "vllm").
Other methods, and rejection_sample_method "synthetic" / "block", keep vLLM's.
"""

from __future__ import annotations

from vllm_dflash import envs


def use_dflash_verifier(spec_config) -> bool:
    if spec_config is None or getattr(spec_config, "method", None) != "dflash":
        return False
    if getattr(spec_config, "rejection_sample_method", "standard") != "standard":
        return False
    choice = envs.VLLM_DFLASH_VERIFIER
    if choice:
        return choice == "dflash"
    return envs.use_plugin_impl()
