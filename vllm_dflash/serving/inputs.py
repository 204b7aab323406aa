"""Per-step inputs of the DFlash drafter, computed from the runner's batch.

The readable specification of what `ops.prepare_dflash_inputs` computes in
one native call on the proposer's hot path (tests/ops checks the two agree):
plain torch on whatever device the batch lives on, no host syncs except the
optional exact context count. Rows are tokens of the target's last forward
pass, request-major (`query_start_loc` delimits requests); in a verification
step a request's rows are `[last verified token, draft_1 .. draft_k]` and the
last `num_rejected` of them were rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ContextRows:
    """Target rows whose hidden states become draft context this step."""

    rows: torch.Tensor  # [n] int64, row indices into the target batch
    slots: torch.Tensor  # [n] int64, KV cache slot of each row, -1 = do not write


@dataclass
class QueryBlock:
    """The query block `[bonus, MASK x k]` of every request, request-major."""

    input_ids: torch.Tensor  # [B * (k + 1)] int32
    positions: torch.Tensor  # [B * (k + 1)] int64
    slots: torch.Tensor  # [B * (k + 1)] int64
    seq_lens: torch.Tensor  # [B] int32: context length + k + 1
    query_start_loc: torch.Tensor  # [B + 1] int32


def select_context_rows(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    num_rows: int,
    exact: bool,
) -> ContextRows:
    """Rows of newly verified tokens: all rows of a request but its rejected tail.

    exact=True returns only those rows (one host sync for the count);
    exact=False keeps all `num_rows` rows, verified ones first, and marks the
    rest with slot -1 so nothing is written for them (no sync).
    """
    device = slot_mapping.device
    all_rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    if num_rejected is None:
        return ContextRows(all_rows, slot_mapping[:num_rows].long())
    ends = query_start_loc[1:].long()
    request = torch.searchsorted(ends, all_rows, right=True).clamp_(max=ends.numel() - 1)
    verified = all_rows < (ends - num_rejected.long())[request]
    if exact:
        rows = verified.nonzero().squeeze(1)
        return ContextRows(rows, slot_mapping[rows].long())
    rows = torch.argsort((~verified).to(torch.int8), stable=True)
    slots = torch.where(verified[rows], slot_mapping[rows].long(), -1)
    return ContextRows(rows, slots)


def build_query_block(
    next_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    num_speculative_tokens: int,
) -> QueryBlock:
    """Block of request i sits at positions [p_i, p_i + k], p_i = 1 + position of
    its last verified token; its slots come from the request's block table."""
    batch_size = next_token_ids.shape[0]
    q_len = num_speculative_tokens + 1
    device = next_token_ids.device
    last_row = query_start_loc[1 : batch_size + 1].long() - 1
    if num_rejected is not None:
        last_row = last_row - num_rejected.long()
    start = target_positions[last_row].long() + 1  # [B]
    offsets = torch.arange(q_len, device=device, dtype=torch.int64)
    positions = (start[:, None] + offsets).reshape(-1)

    input_ids = torch.full((batch_size, q_len), mask_token_id, dtype=torch.int32, device=device)
    input_ids[:, 0] = next_token_ids.to(torch.int32)

    block_idx = (positions // block_size).clamp_(max=block_table.shape[1] - 1)
    blocks = block_table.gather(1, block_idx.view(batch_size, q_len)).view(-1)
    slots = blocks.long() * block_size + positions % block_size

    return QueryBlock(
        input_ids=input_ids.reshape(-1),
        positions=positions,
        slots=slots,
        seq_lens=(start + q_len).to(torch.int32),
        query_start_loc=torch.arange(batch_size + 1, device=device, dtype=torch.int32) * q_len,
    )
