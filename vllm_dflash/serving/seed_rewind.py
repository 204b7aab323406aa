"""Seeded requests with a chunked prefill on CPU: undo the discarded sample by state, not offset.

vLLM samples every scheduled request each step, partial prefills included, and
drops the token of a request whose prompt is not fully computed yet
(`GPUModelRunner.discard_request_mask`). So that a seeded request's output does
not depend on how its prompt was chunked, `_bookkeeping_sync` rewinds that
request's generator with `gen.set_offset(gen.get_offset() - 4)`: a CUDA Philox
detail (vllm-project/vllm#10097, "relies on cuda-specific torch-internal impl
details"). A CPU generator (mt19937) has no offset, torch raises
`RuntimeError: CPU Generator does not use offset`, and the engine dies with
every request in flight. vLLM 0.32's CPU runner (a `GPUModelRunner` subclass)
inherits the call; any seeded request whose prefill is split hits it, with or
without speculative decoding (DFlash makes it likely: k = 15 caps the step at
2048 tokens, so prefills are chunked under load).

The fix restores state instead: `_sample` snapshots (`get_state`) the CPU
generators of the step's discarded requests before anything draws from them,
and `_bookkeeping_sync` puts the snapshots back (after the sampler, the
verifier and the drafter have drawn) and hides those generators from vLLM's
offset rewind. The request then draws its next sample from exactly the state
it would have had without the discarded one, so seeded outputs stay
reproducible and independent of chunking, and the noise that produced the
discarded token is reused only once its token is gone (nothing observed
depends on it, so sampling and DFlash verification keep their distribution).
Generators on other devices keep vLLM's offset rewind.

Remove once vLLM's runner rewinds CPU generators itself (no upstream issue for
the CPU runner as of 0.32.0; the same crash was fixed downstream for a CPU
generator in RBLN-SW/vllm-rbln#1025 by skipping the rewind, which loses
reproducibility across chunkings).
"""

from __future__ import annotations

import numpy as np
import torch

# Attribute of the runner holding this step's snapshots: [(batch index, generator, state)].
_SNAPSHOT = "_vllm_dflash_discarded_rng_states"


def _discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """{batch index: generator} of this step's discarded requests whose generator is on the CPU."""
    batch = runner.input_batch
    if not batch.generators:
        return {}
    discarded = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    found = {}
    for i in discarded.tolist():
        gen = batch.generators.get(i)
        if gen is not None and gen.device.type == "cpu":
            found[i] = gen
    return found


def snapshot_before_sampling(runner) -> None:
    """Called at the start of `_sample`: remember the discarded requests' generator states."""
    setattr(runner, _SNAPSHOT, [(i, gen, gen.get_state()) for i, gen in _discarded_cpu_generators(runner).items()])


def restore_and_hide(runner) -> dict[int, torch.Generator]:
    """Called at the start of `_bookkeeping_sync`: restore the snapshots and return
    the generators dict vLLM's rewind loop may see (without the discarded CPU ones)."""
    snapshots = runner.__dict__.pop(_SNAPSHOT, None) or []
    for _, gen, state in snapshots:
        gen.set_state(state)
    hidden = _discarded_cpu_generators(runner)
    return {i: g for i, g in runner.input_batch.generators.items() if i not in hidden}


def wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        snapshot_before_sampling(self)
        return original(self, logits, spec_decode_metadata)

    return _sample


def wrap_bookkeeping_sync(original):
    def _bookkeeping_sync(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens):
        batch = self.input_batch
        generators = batch.generators
        visible = restore_and_hide(self)
        if len(visible) == len(generators):
            return original(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)
        # vLLM's loop only reads batch.generators; the sampling metadata keeps its own reference.
        batch.generators = visible
        try:
            return original(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)
        finally:
            batch.generators = generators

    return _bookkeeping_sync
