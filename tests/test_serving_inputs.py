"""Per-step drafter inputs (vllm_dflash.serving.inputs) on hand-built batches."""

from __future__ import annotations

import torch

from vllm_dflash.serving.inputs import build_query_block, select_context_rows

# Three requests in one target pass: a verification step with 3 drafts and 2
# rejected (rows 0-3), a prefill chunk (rows 4-8), a verification with none
# rejected (rows 9-12).
QUERY_START_LOC = torch.tensor([0, 4, 9, 13], dtype=torch.int32)
NUM_REJECTED = torch.tensor([2, 0, 0], dtype=torch.int32)
POSITIONS = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 4, 30, 31, 32, 33])
SLOTS = torch.arange(100, 113, dtype=torch.int64)
VERIFIED_ROWS = [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_exact_context_rows_skip_rejected_drafts():
    ctx = select_context_rows(QUERY_START_LOC, NUM_REJECTED, SLOTS, num_rows=13, exact=True)
    assert ctx.rows.tolist() == VERIFIED_ROWS
    assert ctx.slots.tolist() == [100 + r for r in VERIFIED_ROWS]


def test_padded_context_rows_write_the_same_slots_without_a_sync():
    ctx = select_context_rows(QUERY_START_LOC, NUM_REJECTED, SLOTS, num_rows=13, exact=False)
    assert ctx.rows.shape[0] == 13  # fixed size: no host sync for the count
    assert ctx.rows[: len(VERIFIED_ROWS)].tolist() == VERIFIED_ROWS  # verified rows first, in order
    written = [(r, s) for r, s in zip(ctx.rows.tolist(), ctx.slots.tolist()) if s >= 0]
    assert written == [(r, 100 + r) for r in VERIFIED_ROWS]
    assert sorted(ctx.rows.tolist()) == list(range(13))


def test_prefill_only_step_keeps_every_row():
    ctx = select_context_rows(QUERY_START_LOC, None, SLOTS, num_rows=13, exact=True)
    assert ctx.rows.tolist() == list(range(13)) and ctx.slots.tolist() == SLOTS.tolist()


def test_query_block_positions_slots_and_lengths():
    block_size, k, mask = 4, 3, 99
    block_table = torch.tensor([[7, 8, 9, 10, 11], [3, 0, 0, 0, 0], [1, 2, 5, 6, 12], [0, 0, 0, 0, 0]], dtype=torch.int32)
    next_tokens = torch.tensor([41, 42, 43], dtype=torch.int32)
    block = build_query_block(
        next_tokens, POSITIONS, QUERY_START_LOC, NUM_REJECTED, block_table[:3], block_size, mask, k
    )
    # Bonus positions: 1 + last verified position = 12, 5, 34.
    assert block.positions.tolist() == [12, 13, 14, 15, 5, 6, 7, 8, 34, 35, 36, 37]
    assert block.input_ids.tolist() == [41, mask, mask, mask, 42, mask, mask, mask, 43, mask, mask, mask]
    assert block.input_ids.dtype == torch.int32
    expected_slots = []
    for req, start in enumerate([12, 5, 34]):
        for pos in range(start, start + k + 1):
            blk = min(pos // block_size, block_table.shape[1] - 1)
            expected_slots.append(int(block_table[req, blk]) * block_size + pos % block_size)
    assert block.slots.tolist() == expected_slots
    assert block.seq_lens.tolist() == [16, 9, 38]  # context before the block + the block
    assert block.query_start_loc.tolist() == [0, 4, 8, 12]
