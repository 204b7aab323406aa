"""prepare_dflash_inputs: native CPU/CUDA kernels against the torch reference
(`ops.reference.prepare_dflash_inputs_ref`, equal element for element) and hand-computed values."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import ops

# Three requests in one target pass: a verification step with 3 drafts and 2
# rejected (rows 0-3), a prefill chunk (rows 4-8), a verification with none
# rejected (rows 9-12); rows 13-14 are padding.
QSL = torch.tensor([0, 4, 9, 13], dtype=torch.int32)
REJECTED = torch.tensor([2, 0, 0], dtype=torch.int32)
POSITIONS = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 4, 30, 31, 32, 33, 0, 0])
SLOTS = torch.cat([torch.arange(100, 113), torch.tensor([-1, -1])])
VERIFIED = [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12]
BLOCK_TABLE = torch.tensor([[7, 8, 9, 10, 11], [3, 0, 0, 0, 0], [1, 2, 5, 6, 12], [0, 0, 0, 0, 0]], dtype=torch.int32)
NEXT = torch.tensor([41, 42, 43], dtype=torch.int32)
BLOCK, K, MASK = 4, 3, 99


def _both(device, *args, **kwargs):
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    return ops.prepare_dflash_inputs(*args, **kwargs), ops.reference.prepare_dflash_inputs_ref(*args, **kwargs)


def _assert_same(native: ops.DFlashStepInputs, ref: ops.DFlashStepInputs) -> None:
    for name, a, b in zip(ops.DFlashStepInputs._fields, native, ref):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert a.device == b.device, name
        assert a.cpu().tolist() == b.cpu().tolist(), name


def test_hand_built_batch_compact():
    native, ref = _both("cpu", QSL, REJECTED, POSITIONS, SLOTS, NEXT, BLOCK_TABLE[:3], BLOCK, MASK, K, 15, True)
    _assert_same(native, ref)
    assert native.context_rows.tolist() == VERIFIED
    assert native.context_positions.tolist() == POSITIONS[VERIFIED].tolist()
    assert native.context_slots.tolist() == [100 + r for r in VERIFIED]
    # Blocks start one past the last verified position: 12, 5, 34.
    assert native.positions.tolist() == [12, 13, 14, 15, 5, 6, 7, 8, 34, 35, 36, 37]
    assert native.input_ids.tolist() == [41, MASK, MASK, MASK, 42, MASK, MASK, MASK, 43, MASK, MASK, MASK]
    expected_slots = []
    for req, start in enumerate([12, 5, 34]):
        for pos in range(start, start + K + 1):
            blk = min(pos // BLOCK, BLOCK_TABLE.shape[1] - 1)  # 34 // 4 = 8 is clamped to the last column
            expected_slots.append(int(BLOCK_TABLE[req, blk]) * BLOCK + pos % BLOCK)
    assert native.slots.tolist() == expected_slots
    assert native.seq_lens.tolist() == [16, 9, 38]
    assert native.query_start_loc.tolist() == [0, 4, 8, 12]


def test_hand_built_batch_padded(device):
    native, ref = _both(device, QSL, REJECTED, POSITIONS, SLOTS, NEXT, BLOCK_TABLE[:3], BLOCK, MASK, K, 15, False)
    _assert_same(native, ref)
    assert native.context_rows.tolist() == list(range(15))
    assert native.context_positions.tolist() == POSITIONS.tolist()
    written = [(r, s) for r, s in enumerate(native.context_slots.tolist()) if s >= 0]
    assert written == [(r, 100 + r) for r in VERIFIED]  # rejected rows 2, 3 and padding: -1


def test_without_num_rejected_every_row_is_context(device):
    native, ref = _both(device, QSL, None, POSITIONS, SLOTS, NEXT, BLOCK_TABLE, BLOCK, MASK, K, 15, True)
    _assert_same(native, ref)
    assert native.context_rows.tolist() == list(range(15))
    assert native.context_slots.tolist() == SLOTS.tolist()
    assert native.positions.tolist()[::4] == [14, 5, 34]  # one past each request's last row


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("compact", [True, False])
def test_random_batches_match_reference(device, seed, compact):
    if device == "cuda" and compact:
        pytest.skip("compaction needs a host-side count: CPU only (refusal tested below)")
    gen = torch.Generator().manual_seed(seed)
    batch = [1, 2, 4, 7, 16, 3][seed]
    k = [15, 3, 7, 0, 1, 15][seed]
    lens = torch.randint(1, k + 2, (batch,), generator=gen)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    index_dtype = torch.int64 if seed % 2 else torch.int32
    rejected = (torch.rand(batch, generator=gen) * (lens + 1)).long().clamp(max=lens).to(index_dtype)
    rejected[0] = lens[0]  # a request with no verified row (vLLM discards its drafts)
    num_rows = int(qsl[-1]) + seed
    positions = torch.randint(0, 500, (num_rows + 3,), generator=gen)
    slots = torch.randint(-1, 4000, (num_rows + 3,), generator=gen)
    wide = torch.randint(0, 200, (batch + 1, 64), generator=gen, dtype=torch.int32)
    table = wide[:, 3:40]  # row-strided view, as the runner's block table
    next_ids = torch.randint(0, 1000, (batch,), generator=gen, dtype=index_dtype)
    for rej in (rejected, None):
        native, ref = _both(device, qsl, rej, positions, slots, next_ids, table, 16, 5, k, num_rows, compact)
        _assert_same(native, ref)
    assert native.input_ids.shape[0] == batch * (k + 1)


def test_request_without_verified_rows_starts_at_its_first_row():
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    rejected = torch.tensor([2, 1], dtype=torch.int32)
    positions = torch.tensor([7, 8, 20, 21, 22])
    step = ops.prepare_dflash_inputs(
        qsl, rejected, positions, torch.arange(5), torch.tensor([1, 2]), torch.zeros(2, 4, dtype=torch.int32),
        16, 0, 2, 5, True,
    )  # fmt: skip
    assert step.context_rows.tolist() == [2, 3]
    assert step.positions.tolist() == [7, 8, 9, 22, 23, 24]


def test_empty_batch(device):
    empty_i32 = torch.empty(0, dtype=torch.int32)
    native, ref = _both(
        device, torch.zeros(1, dtype=torch.int32), empty_i32, torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64), empty_i32, torch.zeros(0, 4, dtype=torch.int32), 16, 0, 3, 0, False,
    )  # fmt: skip
    _assert_same(native, ref)
    assert native.input_ids.numel() == 0 and native.query_start_loc.tolist() == [0]


def test_cuda_refuses_compaction():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = [t.cuda() for t in (QSL, REJECTED, POSITIONS, SLOTS, NEXT, BLOCK_TABLE)]
    with pytest.raises(ValueError, match="compact=True needs a host-side count"):
        ops.prepare_dflash_inputs(*args, BLOCK, MASK, K, 15, True)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(qsl=torch.tensor([0, 4, 9, 16], dtype=torch.int32)), "query_start_loc spans rows"),
        (dict(qsl=QSL.long()), "query_start_loc must be 1-D int32"),
        (dict(rejected=torch.tensor([2, -1, 0], dtype=torch.int32)), "num_rejected must be >= 0"),
        (dict(table=BLOCK_TABLE[:2]), "block_table must be a row-major int32"),
        (dict(table=BLOCK_TABLE.t().contiguous().t()[:3]), "block_table must be a row-major int32"),
        (dict(positions=POSITIONS[:10]), "target_positions must be 1-D int64 with at least num_rows"),
        (dict(slots=SLOTS.int()), "slot_mapping must be 1-D int64"),
        (dict(block_size=0), "block_size must be positive"),
    ],
)
def test_bad_input_raises_value_error(change, match):
    args = dict(qsl=QSL, rejected=REJECTED, positions=POSITIONS, slots=SLOTS, table=BLOCK_TABLE[:3], block_size=BLOCK)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        ops.prepare_dflash_inputs(
            args["qsl"], args["rejected"], args["positions"], args["slots"], NEXT, args["table"],
            args["block_size"], MASK, K, 15, True,
        )  # fmt: skip


def test_opcheck(device):
    args = [t.to(device) for t in (QSL, REJECTED, POSITIONS, SLOTS, NEXT, BLOCK_TABLE[:3])]
    torch.library.opcheck(
        torch.ops.vllm_dflash.prepare_dflash_inputs.default, (*args, BLOCK, MASK, K, 15, device == "cpu")
    )
