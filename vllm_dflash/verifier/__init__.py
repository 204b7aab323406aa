"""Rejection-sampling verifier: keeps exactly the target's output distribution.

Greedy requests get the target's argmax tokens; sampled requests get the
target's distribution after temperature, min-p, top-k and top-p (Leviathan et
al. 2023), with argmax (point-mass) or sampled draft tokens. The kernels live in
csrc/ (torch.ops.vllm_dflash.rejection_sample, dispatched by vllm_dflash.ops);
`vllm_dflash.ops.reference.rejection_sample_ref` is their specification; `sampler` plugs the verifier into vLLM (imports vLLM, so it is
not imported here).
"""

from vllm_dflash.ops.reference import PLACEHOLDER_TOKEN_ID
from vllm_dflash.verifier.rejection import draw_noise, rejection_sample, verify

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "draw_noise",
    "rejection_sample",
    "verify",
]
