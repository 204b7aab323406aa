"""Loading of the native library `vllm_dflash._C` and what it tells torch.

Importing `_C` registers `torch.ops.vllm_dflash.*` (schemas in
csrc/torch_bindings.cpp; CPU kernels in csrc/cpu_bindings.cpp, CUDA kernels in
csrc/cuda_bindings.cpp). The fake (meta) implementations below let
torch.compile and FakeTensor trace every op. `HAS_NATIVE` is False when the
extension is not built; every op then runs its pure-torch reference.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm_dflash")

HAS_NATIVE = False
try:
    from vllm_dflash import _C  # noqa: F401  (registers torch.ops.vllm_dflash.*)

    HAS_NATIVE = True
except ImportError as e:  # pragma: no cover - exercised only without a build
    logger.warning(
        "vllm_dflash._C is not built (%s); using the slower pure-torch ops. "
        "Build it with `pip install --no-build-isolation --no-deps -e .`.",
        e,
    )


def _register_fakes() -> None:
    @torch.library.register_fake("vllm_dflash::gather_hidden_states")
    def _gather_hidden_states_fake(hidden_states, indices):
        h0 = hidden_states[0]
        return h0.new_empty((indices.shape[0], len(hidden_states) * h0.shape[1]))

    @torch.library.register_fake("vllm_dflash::gather_hidden_states_out")
    def _gather_hidden_states_out_fake(hidden_states, indices, out):
        return None

    @torch.library.register_fake("vllm_dflash::store_context_kv_layer")
    def _store_context_kv_layer_fake(key, value, kv_cache, slot_mapping, layout):
        return None

    @torch.library.register_fake("vllm_dflash::store_context_kv_fused")
    def _store_context_kv_fused_fake(key, value, k_norm_weight, eps, cos_sin_cache, positions, is_neox, kv_caches,
                                     slot_mapping, layout):  # fmt: skip
        return None

    @torch.library.register_fake("vllm_dflash::rms_norm")
    def _rms_norm_fake(input, weight, eps):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @torch.library.register_fake("vllm_dflash::logits_top2")
    def _logits_top2_fake(logits):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)

    @torch.library.register_fake("vllm_dflash::prepare_dflash_inputs")
    def _prepare_dflash_inputs_fake(query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids,
                                    block_table, block_size, mask_token_id, num_speculative_tokens, num_rows,
                                    compact):  # fmt: skip
        batch, q_len = next_token_ids.shape[0], num_speculative_tokens + 1
        n = torch.library.get_ctx().new_dynamic_size() if compact and num_rejected is not None else num_rows
        i64 = dict(dtype=torch.int64, device=next_token_ids.device)
        i32 = dict(dtype=torch.int32, device=next_token_ids.device)
        return (
            torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **i64),
            torch.empty(batch * q_len, **i32), torch.empty(batch * q_len, **i64), torch.empty(batch * q_len, **i64),
            torch.empty(batch, **i32), torch.empty(batch + 1, **i32),
        )  # fmt: skip

    @torch.library.register_fake("vllm_dflash::rejection_sample")
    def _rejection_sample_fake(draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs, bonus_token_ids,
                               is_greedy, uniforms, exp_noise, max_spec_len):  # fmt: skip
        return target_probs.new_empty((cu_num_draft_tokens.shape[0], max_spec_len + 1), dtype=torch.int32)


if HAS_NATIVE:
    _register_fakes()
