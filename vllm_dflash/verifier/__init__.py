"""Rejection-sampling verifier: keeps exactly the target's output distribution.

Greedy requests get the target's argmax tokens; sampled requests get the
target's distribution after temperature, min-p, top-k and top-p (Leviathan et
al. 2023), with argmax (point-mass) or sampled draft tokens. The kernels live in
csrc/ (torch.ops.vllm_dflash.rejection_sample); `reference` is their
specification; `sampler` plugs the verifier into vLLM (imports vLLM, so it is
not imported here).
"""

from vllm_dflash.verifier.draft import sample_drafts
from vllm_dflash.verifier.reference import PLACEHOLDER_TOKEN_ID, rejection_sample_reference
from vllm_dflash.verifier.rejection import draw_noise, native_available, rejection_sample, verify

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "draw_noise",
    "native_available",
    "rejection_sample",
    "rejection_sample_reference",
    "sample_drafts",
    "verify",
]
