"""The queue of context writes held back while adaptive speculation drafts nothing
(vllm_dflash.serving.context_queue): written later in one batch, the draft's cache
must end exactly as per-step writes would have left it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.adaptive.write_cost import ContextWriteCost
from vllm_dflash.serving.context_queue import ContextRows, DeferredContext, last_write_per_slot


def rows(n: int, first_slot: int, width: int = 6, seed: int = 0) -> ContextRows:
    g = torch.Generator().manual_seed(seed)
    return ContextRows(torch.randn(n, width, generator=g), torch.arange(n) + 100 * seed,
                       torch.arange(first_slot, first_slot + n))


def write(cache: torch.Tensor, batch: ContextRows) -> None:
    """A store that writes rows in any order, as a parallel kernel may (reversed here)."""
    for i in reversed(range(batch.slots.shape[0])):
        slot = int(batch.slots[i])
        if slot >= 0:
            cache[slot] = batch.features[i]


def test_last_write_per_slot_keeps_only_the_last_row_of_each_slot():
    slots = torch.tensor([5, 7, -1, 5, 9, 7, 5, -1])
    assert last_write_per_slot(slots).tolist() == [-1, -1, -1, -1, 9, 7, 5, -1]
    unique = torch.tensor([3, 1, 2])
    assert last_write_per_slot(unique) is unique
    assert last_write_per_slot(torch.tensor([4])).tolist() == [4]


def test_a_batched_write_leaves_the_cache_of_per_step_writes():
    """Steps whose slots overlap (a finished request's slots reused by a later one):
    the queued batch, written in any row order, ends with the later rows."""
    steps = [rows(3, 0, seed=1), rows(2, 10, seed=2), rows(4, 1, seed=3), rows(1, 10, seed=4)]
    per_step = torch.zeros(16, 6)
    for step in steps:
        write(per_step, step)
    queue = DeferredContext(max_rows=100)
    for step in steps[:-1]:
        assert queue.hold(step)
    assert queue.rows == 9
    batched = torch.zeros(16, 6)
    write(batched, queue.take(steps[-1]))
    assert torch.equal(batched, per_step)
    assert queue.rows == 0 and queue.take() is None


def test_held_rows_are_copies():
    """The runner reuses its position and slot buffers (and a target pass's hidden states) next step."""
    step = rows(2, 0)
    queue = DeferredContext(max_rows=8)
    assert queue.hold(step)
    expected = [t.clone() for t in step]
    for t in step:
        t.fill_(-7)
    taken = queue.take()
    assert all(torch.equal(a, b) for a, b in zip(taken, expected))


def test_a_full_queue_refuses_and_take_writes_everything_in_order():
    queue = DeferredContext(max_rows=5)
    assert queue.hold(rows(3, 0, seed=1))
    assert not queue.hold(rows(3, 3, seed=2))  # 6 > 5: the caller writes now
    assert queue.rows == 3
    batch = queue.take(rows(3, 3, seed=2))
    assert batch.slots.tolist() == [0, 1, 2, 3, 4, 5]
    assert batch.positions.tolist() == [100, 101, 102, 200, 201, 202]


def test_multi_row_positions_are_never_held():
    """M-RoPE positions ([3, n]) would not concatenate by row: such steps write at once."""
    step = ContextRows(torch.zeros(2, 4), torch.zeros(3, 2, dtype=torch.long), torch.arange(2))
    assert not DeferredContext(max_rows=8).hold(step)


def test_max_rows_must_be_positive():
    with pytest.raises(ValueError, match="max_rows=0"):
        DeferredContext(0)


def test_per_layer_blocks_are_held_side_by_side():
    """The proposer hands the target layers' hidden states as blocks: held, they equal
    their concatenation, and a block layout that does not fill the row is refused."""
    step = rows(3, 0, width=6)
    blocks = ContextRows((step.features[:, :2], step.features[:, 2:]), step.positions, step.slots)
    queue = DeferredContext(max_rows=8)
    assert queue.hold(blocks) and queue.hold(rows(1, 5, seed=1))
    taken = queue.take()
    assert torch.equal(taken.features, torch.cat([step.features, rows(1, 5, seed=1).features]))
    assert taken.slots.tolist() == [0, 1, 2, 5]
    assert queue.hold(blocks)
    with pytest.raises(ValueError, match="2 feature columns held, the queue's rows have 6"):
        queue.hold(ContextRows((step.features[:, :2],), step.positions, step.slots))


def test_the_queue_reuses_one_buffer():
    """Held rows live in buffers that double when full and are kept: after the first
    cycles a hold / take cycle allocates no queue memory (a tensor per held step had
    fragmented the heap into a page fault per 4 KiB of every step's transient tensors)."""
    queue = DeferredContext(max_rows=64)
    for cycle in range(3):
        for step in range(5):
            assert queue.hold(rows(4, 4 * step, seed=step))
        if cycle == 0:
            buffers = [t.data_ptr() for t in queue._buffers]
            assert queue.capacity == 32  # 4 -> 8 -> 16 -> 32 rows
        taken = queue.take(rows(2, 40, seed=9))
        assert torch.equal(taken.features[:4], rows(4, 0, seed=0).features)
        assert taken.slots.tolist() == list(range(20)) + [40, 41]
        assert [t.data_ptr() for t in queue._buffers] == buffers and queue.capacity == 32


def test_a_host_hold_of_a_decode_step_queues_what_hold_queues():
    """hold_on_host (a coasting step's copies only: per-layer blocks, which may be padded past
    the step's rows, and numpy views of positions and slots) leaves the queue exactly as hold()
    does, and refuses, holding nothing, where hold() must decide: before any host buffers
    exist, and when the rows would pass max_rows."""
    import numpy as np

    quick, full = DeferredContext(max_rows=12, prefault=True), DeferredContext(max_rows=12, prefault=True)
    first = rows(3, 0, seed=1)
    blocks = [first.features[:, :2], first.features[:, 2:]]
    assert not quick.room_on_host(3)
    assert not quick.hold_on_host(blocks, first.positions.numpy(), first.slots.numpy(), 3, ["a", "b", "c"])
    assert quick.rows == 0
    assert quick.hold(first, ["a", "b", "c"]) and full.hold(first, ["a", "b", "c"])
    for step in range(1, 4):
        r = rows(3, 3 * step, seed=step + 1)
        padded = torch.cat([r.features, torch.full((2, 6), 7.0)])  # the target ran 5 rows (GEMM grid)
        position_buffer = np.concatenate([r.positions.numpy(), [-1, -1]])
        slot_buffer = np.concatenate([r.slots.numpy(), [-1, -1]])
        assert quick.room_on_host(3) and not quick.room_on_host(13 - 3 * step)
        assert quick.hold_on_host([padded[:, :4], padded[:, 4:]], position_buffer, slot_buffer, 3, ["a", "b", "c"])
        assert full.hold(r, ["a", "b", "c"])
    assert quick.rows == full.rows == 12
    extra = rows(1, 40, seed=9)
    assert not quick.room_on_host(1)
    assert not quick.hold_on_host([extra.features], extra.positions.numpy(), extra.slots.numpy(), 1, ["a"])
    assert quick.rows == 12 and quick._owners == full._owners
    mine, theirs = quick.take(live={"a", "b"}), full.take(live={"a", "b"})
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert mine.slots.tolist() == [s for s in range(12) if s % 3 != 2]


def test_a_prefaulted_queue_is_allocated_whole_at_its_first_hold():
    """On the host the queue's buffers are allocated at max_rows and touched (zeroed) by the
    first hold, so no later step grows them; a take of a full queue plus a step's own rows
    still fits (it grows past max_rows), and what is taken is what was held."""
    queue = DeferredContext(max_rows=20, prefault=True)
    assert queue.capacity == 0  # nothing allocated before the first hold
    assert queue.hold(rows(4, 0, seed=0))
    buffers = [t.data_ptr() for t in queue._buffers]
    assert queue.capacity == 20 and torch.count_nonzero(queue._buffers.features[4:]) == 0
    for step in range(1, 5):
        assert queue.hold(rows(4, 4 * step, seed=step))
    assert [t.data_ptr() for t in queue._buffers] == buffers
    assert not queue.hold(rows(4, 30, seed=7))  # full: 20 rows
    taken = queue.take(rows(4, 30, seed=7))
    assert queue.capacity == 40 and taken.slots.tolist() == list(range(20)) + [30, 31, 32, 33]
    assert torch.equal(taken.features[8:12], rows(4, 8, seed=2).features)


def test_rows_of_finished_requests_are_dropped_and_the_live_cache_is_unchanged():
    """Requests a, b, c hold rows; a finishes, and its freed slots go to d. Written with
    live = {b, c, d}, the cache holds what per-step writes leave at every live row's slot,
    and a's rows are never written (its slots hold d's rows or nothing)."""
    a, b = rows(2, 0, seed=1), rows(2, 4, seed=2)
    step1 = ContextRows(*(torch.cat(p) for p in zip(a, b)))
    c = rows(1, 8, seed=3)
    d = rows(1, 0, seed=4)  # a's first slot, reused
    queue = DeferredContext(max_rows=100)
    assert queue.hold(step1, owners=["a", "a", "b", "b"])
    assert queue.hold(c, owners=["c"])
    with pytest.raises(ValueError, match="2 owners for 1 rows"):
        queue.hold(d, owners=["d", "d"])
    per_step = torch.zeros(16, 6)
    for step in (step1, c, d):
        write(per_step, step)
    batched = torch.zeros(16, 6)
    write(batched, queue.take(d, live={"b", "c", "d"}))
    for slot in (0, 4, 5, 8):  # d's, b's and c's
        assert torch.equal(batched[slot], per_step[slot]), slot
    assert not batched[1].any()  # a's second row: dropped, never written
    assert queue.dropped_rows == 2 and queue.rows == 0


def test_rows_without_owners_or_without_live_are_all_written():
    """Owners unknown, or no live set (prefix caching: a later request may read a finished
    one's blocks): nothing is dropped."""
    queue = DeferredContext(max_rows=100)
    assert queue.hold(rows(2, 0, seed=1))
    assert queue.hold(rows(1, 4, seed=2), owners=["gone"])
    assert queue.take(live={"other"}).slots.tolist() == [0, 1]  # the unowned rows stay
    assert queue.hold(rows(1, 4, seed=2), owners=["gone"])
    assert queue.take().slots.tolist() == [4]
    assert queue.hold(rows(1, 4, seed=2), owners=["gone"])
    assert queue.take(live=set()) is None and queue.dropped_rows == 2


def _writing_proposer(model, queue: DeferredContext):
    """A DFlashProposer with only what `_write_context` reads: the draft model's context
    store, the queue, one live request, no step time counted yet and no prompt rows."""
    from vllm_dflash.serving import proposer as proposer_module

    p = object.__new__(proposer_module.DFlashProposer)
    p.model, p.deferred_context = model, queue
    p.runner = SimpleNamespace(requests={"live": object()})
    p._drop_finished_context, p._not_drafting_seconds = True, 0.0
    p._context_write_cost = ContextWriteCost()
    p._prompt_rows = 0
    return p


def test_the_held_rows_share_of_a_write_counts_only_rows_written(monkeypatch):
    """A drafting step writes the held rows with its own: the held rows' share of that time
    belongs to the steps that held them, not to this step's draft time. Rows of finished
    requests dropped at the write are not part of it: 10 held rows (8 of a finished request)
    and 2 new ones write 4 rows in 4 ms, of which the 2 held rows' share is 2 ms (counting
    the 10 held rows made it 10 ms, more than the whole write, and the draft-time sample 0)."""
    from vllm_dflash.serving import proposer as proposer_module

    clock = [0.0]
    monkeypatch.setattr(proposer_module.time, "perf_counter", lambda: clock[0])

    class Model:
        def store_context_kv(self, features, positions, slots):
            clock[0] += 1e-3 * features.shape[0]  # 1 ms per row written

    p = _writing_proposer(Model(), DeferredContext(max_rows=100))
    p._write_context(rows(8, 0, seed=1), hold=True, owners=["gone"] * 8)
    p._write_context(rows(2, 8, seed=2), hold=True, owners=["live"] * 2)
    assert clock[0] == 0.0 and p.deferred_context.rows == 10  # held, nothing written yet
    p._write_context(rows(2, 10, seed=3), hold=False)
    assert clock[0] == pytest.approx(4e-3) and p.deferred_context.dropped_rows == 8
    assert p._not_drafting_seconds == pytest.approx(2e-3)
    assert p._context_write_cost.per_row() == pytest.approx(1e-3)  # per row written: what the next switch is priced at


def test_prompt_rows_share_of_a_context_write_is_left_out_of_the_draft_time(monkeypatch):
    """A step's prompt-chunk rows cost context time whatever q is, so their share is not
    draft time: held (a step without drafting) or written with the step's own rows and
    the held ones. 3 prompt rows of 4 held in 4 ms: 3 ms; then 2 held rows, 1 decode row
    and 1 prompt row written in 4 ms: 2 ms for the held rows, 1 ms for the prompt row."""
    from vllm_dflash.serving import proposer as proposer_module

    clock = [0.0]
    monkeypatch.setattr(proposer_module.time, "perf_counter", lambda: clock[0])

    class Model:
        def store_context_kv(self, features, positions, slots):
            clock[0] += 1e-3 * features.shape[0]

    class Queue(DeferredContext):
        def hold(self, rows, owners=None, live=None):
            clock[0] += 1e-3 * rows.slots.shape[0]  # 1 ms per row held
            return super().hold(rows, owners, live)

    p = _writing_proposer(Model(), Queue(max_rows=100))
    p._prompt_rows = 3
    p._write_context(rows(4, 0, seed=1), hold=True, owners=["live"] * 4)
    assert p._not_drafting_seconds == pytest.approx(3e-3)
    p._not_drafting_seconds, p.deferred_context = 0.0, DeferredContext(max_rows=100)
    assert p.deferred_context.hold(rows(2, 4, seed=2), owners=["live"] * 2)
    p._prompt_rows = 1
    p._write_context(rows(2, 6, seed=3), hold=False)
    assert clock[0] == pytest.approx(8e-3)
    assert p._not_drafting_seconds == pytest.approx(3e-3)
    p._not_drafting_seconds, p._prompt_rows = 0.0, 0  # a decode step writing alone: all draft time
    p._write_context(rows(2, 8, seed=4), hold=False)
    assert p._not_drafting_seconds == 0.0


def test_a_full_queue_writes_per_layer_blocks_with_the_held_rows(monkeypatch):
    """A step without drafting hands its rows as per-layer blocks; when the queue is full
    they are written at once, after the held rows, as one batch."""
    written = []

    class Model:
        def store_context_kv(self, features, positions, slots):
            written.append((features.clone(), slots.clone()))

    p = _writing_proposer(Model(), DeferredContext(max_rows=4))
    held, step = rows(3, 0, seed=1), rows(2, 3, seed=2)
    as_blocks = lambda r: r._replace(features=(r.features[:, :4], r.features[:, 4:]))  # noqa: E731
    p._write_context(as_blocks(held), hold=True, owners=["live"] * 3)
    assert not written and p.deferred_context.rows == 3
    p._write_context(as_blocks(step), hold=True, owners=["live"] * 2)  # 5 > 4 rows: written now
    (features, slots), = written
    assert torch.equal(features, torch.cat([held.features, step.features])) and slots.tolist() == [0, 1, 2, 3, 4]
    assert p.deferred_context.rows == 0


def test_held_rows_on_the_host_fill_a_memory_budget_and_on_a_device_one_step():
    """In host memory the queue may hold HOST_BYTES of features (most rows then belong to
    requests that finish first and are never written); on an accelerator, one step's
    token budget, and never less than that anywhere."""
    from vllm_dflash.serving.context_queue import HOST_BYTES, max_held_rows

    row = 5 * 320 * 4  # five target layers of the bundled pair's hidden size, float32
    assert max_held_rows(2048, row, on_host=True) == HOST_BYTES // row > 2048
    assert max_held_rows(4096, row, on_host=False) == 4096
    assert max_held_rows(4096, 5 * 8192 * 2 * 64, on_host=True) == 4096  # huge rows: the budget still holds
    assert max_held_rows(4096, 0, on_host=True) == 4096


def test_switch_cost_prices_the_live_held_rows_and_counts_the_tokens_left():
    """What turning drafting back on costs (`DFlashProposer._switch_cost`): the held rows of
    live requests at the measured seconds per row (a finished request's rows are never
    written), and the output tokens the batch has left; a request without max_tokens makes
    the tokens left unbounded (None)."""
    from vllm_dflash.serving import proposer as proposer_module

    def state(max_tokens, produced):
        return SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens),
                               output_token_ids=[0] * produced)

    p = object.__new__(proposer_module.DFlashProposer)
    p.deferred_context = DeferredContext(max_rows=100)
    p.runner = SimpleNamespace(requests={"a": state(64, 10), "b": state(32, 30)})
    p._drop_finished_context, p._context_write_cost = True, ContextWriteCost()
    assert p.deferred_context.hold(rows(3, 0, seed=1), owners=["a", "gone", "b"])
    assert p.deferred_context.hold(rows(2, 3, seed=2), owners=["a", "b"])
    assert p._switch_cost(["a", "b"]) == (0.0, None)  # no write measured yet: nothing to price
    # writes of 1 and 10 rows at 5 ms a write plus 2 ms a row: held rows cost 2 ms each (the
    # drafting step pays the 5 ms whether or not rows were held)
    p._context_write_cost.add(1, 7e-3)
    p._context_write_cost.add(10, 25e-3)
    seconds, left = p._switch_cost(["a", "b"])
    assert p.deferred_context.live_rows(p.runner.requests) == 4 and p.deferred_context.live_rows(None) == 5
    assert seconds == pytest.approx(8e-3) and left == (64 - 10) + (32 - 30)
    p.runner.requests["b"] = state(None, 30)
    assert p._switch_cost(["a", "b"]) == (pytest.approx(8e-3), None)
    p._drop_finished_context = False  # prefix caching: every held row is written
    assert p._switch_cost(["a"])[0] == pytest.approx(10e-3)


def test_a_full_queue_drops_finished_requests_rows_and_holds_on():
    """Six rows fit. a holds 3, b 2; a finishes. c's 2 rows would overflow: the rows of a
    (not live) are dropped first, which leaves room (4 of 6 rows, within the 3/4 kept free
    of compaction's churn), so c is held; the cache written later is what per-step writes
    leave at b's and c's slots, a's never written. Where compaction frees too little, the
    queue refuses (the caller writes everything), as without `live`."""
    a, b, c = rows(3, 0, seed=1), rows(2, 4, seed=2), rows(2, 0, seed=3)  # c reuses a's slots 0, 1
    queue = DeferredContext(max_rows=6)
    assert queue.hold(a, owners=["a"] * 3) and queue.hold(b, owners=["b"] * 2)
    assert not queue.hold(c, owners=["c"] * 2)  # no live set: a full queue refuses
    assert queue.hold(c, owners=["c"] * 2, live={"b", "c"})
    assert queue.rows == 4 and queue.dropped_rows == 3
    per_step, batched = torch.zeros(8, 6), torch.zeros(8, 6)
    for step in (a, b, c):
        write(per_step, step)
    write(batched, queue.take(live={"b", "c"}))
    for slot in (0, 1, 4, 5):
        assert torch.equal(batched[slot], per_step[slot]), slot
    assert not batched[2].any()  # a's last row: dropped, never written
    full = DeferredContext(max_rows=6)
    assert full.hold(rows(5, 0, seed=4), owners=["x"] * 4 + ["gone"])
    assert not full.hold(rows(2, 5, seed=5), owners=["x"] * 2, live={"x"})  # 4 + 2 rows > 3/4 of 6
    assert full.rows == 4 and full.take(live={"x"}).slots.tolist() == [0, 1, 2, 3]


def test_live_rows_counts_what_a_take_would_write_through_holds_compactions_and_takes():
    """`live_rows` keeps per-request counts between calls; after every kind of change to the
    queue it must still equal the rows `take(live=...)` writes (checked on a copy of the queue)."""
    import copy
    import random

    rng = random.Random(0)
    queue = DeferredContext(max_rows=40)
    slot = 0
    for step in range(60):
        owners = [rng.choice(["a", "b", "c", "d", None]) for _ in range(rng.randint(1, 4))]
        live = set(rng.sample(["a", "b", "c", "d"], rng.randint(0, 4)))
        if None in owners:  # a batch is owned row by row or not at all
            owners = None
        n = rng.randint(1, 4) if owners is None else len(owners)
        if not queue.hold(rows(n, slot, seed=step), owners, live):
            queue.take(rows(n, slot, seed=step), live)
        slot += n
        expected = copy.deepcopy(queue).take(live=live)
        written = 0 if expected is None else int((expected.slots >= 0).sum())
        assert queue.live_rows(live) == written, step
        assert queue.live_rows(None) == queue.rows
        if step % 7 == 6:
            queue.compact(live)
            assert queue.live_rows(live) == queue.rows
