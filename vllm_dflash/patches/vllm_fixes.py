"""Fixes of vLLM bugs that have nothing to do with DFlash: they apply in every
process that loads the plugin, with or without speculation (plugin_only=False)."""

from __future__ import annotations

from vllm_dflash.patches.internal import VllmInternal, wrap_once

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

_SEED_REWIND_UPSTREAM = (
    "vllm-project/vllm#10097 introduced the offset rewind ('relies on cuda-specific torch-internal impl "
    "details'); no vLLM issue for the CPU runner as of 0.32.0; same crash fixed downstream in "
    "RBLN-SW/vllm-rbln#1025"
)
_SEED_REWIND_REMOVAL = (
    "when GPUModelRunner._bookkeeping_sync no longer calls set_offset on CPU generators "
    "(tests/serving/test_seeded_chunked_prefill.py::test_vllm_still_rewinds_by_offset fails then)"
)


def _rewind_discarded_cpu_generators() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dflash.serving import seed_rewind

    wrap_once(GPUModelRunner, "_sample", seed_rewind.wrap_sample)
    wrap_once(GPUModelRunner, "_bookkeeping_sync", seed_rewind.wrap_bookkeeping_sync)


ENTRIES: list[VllmInternal] = [
    VllmInternal(
        symbol=f"{RUNNER}._sample",
        kind="patch",
        process=("worker",),
        why="snapshot (get_state) the CPU generators of this step's discarded requests (partial prefills) "
        "before the sampler, verifier and drafter draw from them, for the state rewind of _bookkeeping_sync",
        how="wrap: vllm_dflash.serving.seed_rewind.wrap_sample",
        remove_when=_SEED_REWIND_REMOVAL,
        upstream=_SEED_REWIND_UPSTREAM,
        params=("self", "logits", "spec_decode_metadata"),
        install=_rewind_discarded_cpu_generators,
        plugin_only=False,
    ),
    VllmInternal(
        symbol=f"{RUNNER}._bookkeeping_sync",
        kind="patch",
        process=("worker",),
        why="vLLM rewinds a discarded seeded sample with Generator.set_offset, which a CPU generator (mt19937) "
        "does not have: a seeded request with a chunked prefill kills the CPU engine ('CPU Generator does not "
        "use offset'); restore the snapshot instead and hide those generators from vLLM's loop (other devices "
        "keep vLLM's rewind)",
        how="wrap: vllm_dflash.serving.seed_rewind.wrap_bookkeeping_sync",
        remove_when=_SEED_REWIND_REMOVAL,
        upstream=_SEED_REWIND_UPSTREAM,
        params=("self", "scheduler_output", "sampler_output", "logits", "hidden_states", "num_scheduled_tokens"),
        used_by=RUNNER,
        usage=("gen.set_offset(", "self.discard_request_mask"),
        install=_rewind_discarded_cpu_generators,
        plugin_only=False,
    ),
]
