"""prepare_dflash_inputs: one drafting step's indices from the runner's batch."""

from __future__ import annotations

import torch

from vllm_dflash.ops import dispatch, reference
from vllm_dflash.ops.reference import DFlashStepInputs


def prepare_dflash_inputs(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    target_positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    next_token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    num_speculative_tokens: int,
    num_rows: int,
    compact: bool,
) -> DFlashStepInputs:
    """Everything one drafting step needs from the runner's batch, in one call.

    The target pass has ``num_rows`` rows, request-major: request r owns rows
    ``[query_start_loc[r], query_start_loc[r+1])``, and in a verification step
    its last ``num_rejected[r]`` rows were rejected (None: a step without
    drafts, every row counts). B = ``len(next_token_ids)``.

    - Context: the verified rows, whose hidden states become draft K/V at
      their own positions and ``slot_mapping`` slots. ``compact=True`` returns
      only them (the count needs the host: CPU only); ``compact=False``
      returns all ``num_rows`` rows in order with slot -1 for rejected and
      padding rows (no host sync). Without num_rejected every row is context.
    - Query block of request r: ids ``[next_token_ids[r], mask_token_id x k]``
      at positions ``p_r .. p_r + k``, p_r = 1 + position of r's last verified
      row (a request without one, whose drafts vLLM discards, starts at its
      first row's position); slots from row r of ``block_table`` (int32,
      block index clamped to its width) with ``block_size``;
      ``seq_lens[r] = p_r + k + 1``, ``query_start_loc[r] = r * (k + 1)``.
    """
    if not dispatch.use_native("prepare_dflash_inputs", next_token_ids.device.type):
        return reference.prepare_dflash_inputs_ref(
            query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids, block_table,
            block_size, mask_token_id, num_speculative_tokens, num_rows, compact,
        )  # fmt: skip
    return DFlashStepInputs(
        *torch.ops.vllm_dflash.prepare_dflash_inputs(
            query_start_loc, num_rejected, target_positions, slot_mapping, next_token_ids, block_table,
            block_size, mask_token_id, num_speculative_tokens, num_rows, compact,
        )  # fmt: skip
    )
