"""Context K/V writes held back while speculation is off, written in one call when it resumes.

A step that drafts nothing still owes the draft's cache the context K/V of
its new tokens, but nothing reads that cache until the next query-block
forward: the only readers are draft forwards, and every draft forward is
preceded by `take()`. So steps without drafting queue their rows here, and
the first drafting step writes them all, in queue order, together with its
own, in one call (one fc GEMM, one K/V GEMM, one cache store instead of one
of each per step). The cache then holds exactly what per-step writes would
have left:

- writes land in the order they were made: a slot that a finished or
  preempted request's queued row targets and a later request reuses ends
  with the later request's K/V (`take` drops every row whose slot a later
  row also writes, so a parallel store has no race);
- a prefix-cache hit reads another request's blocks only in a draft
  forward, after `take`.

At most `max_rows` rows wait (`max_held_rows`: the engine's token budget per
step, what a single step's features already occupy; in host memory, as many
as `HOST_BYTES` hold); a step that would overflow first drops the rows of
finished requests (`compact`), and if that leaves too little room writes the
queue and itself at once.

The rows wait in one buffer per field, grown by doubling and kept (in host
memory allocated whole and touched at the first hold: `prefault`): a queue of
one small tensor per step, interleaved on the heap with each step's
short-lived megabyte tensors (logits, activations), fragmented glibc's heap so
that it grew by about a step's transient size every step: 700 page faults a
step and 3-4 ms of first touches in the sampler at 64 requests in bfloat16
(0.69x of no speculation in steps that drafted nothing), and RSS rising by
~1.4 MB a step until the queue flushed.

Rows of a request that finished while they waited need not be written at
all when nothing can read them later: without prefix caching a finished
request's blocks are only ever read again by the request that reuses them,
after writing its own rows there. So held rows carry their request's id, and
`take(live=...)` drops those of requests no longer live (with prefix caching
on, the caller passes no `live`: a later request may hit the finished one's
blocks, so every row is written). While speculation is off for good (many
requests), most rows then finish unwritten: the context write, a few percent
of the target's arithmetic per token, is not paid at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from typing import NamedTuple

import numpy as np
import torch


HOST_BYTES = 64 << 20
# A full queue first drops the rows of requests that finished (`hold(live=...)`); it keeps holding
# only if that leaves this share of it free, else everything is written (compacting a queue of
# mostly live rows every step would cost more than it saves).
COMPACT_FREE_SHARE = 0.25


def max_held_rows(token_budget: int, row_bytes: int, on_host: bool) -> int:
    """How many context rows may wait. A flush writes the rows of every request still
    running; the longer the queue, the more rows belong to requests that finished before
    it filled and are never written. On an accelerator the queue takes memory vLLM did
    not profile for, so it stays at one step's worth (`token_budget`). In host memory
    (CPU inference) `HOST_BYTES` of features may wait: measured on the bundled pair at 64
    requests, flushing a token budget's worth of rows every 64 steps was 1.7% of the
    step time of a step without drafting (3.6 us a row, most rows still live). The
    queue's buffer is touched page by page as it first fills: at 128 MiB (float32, 32
    requests) growing it cost 0.16-0.57 ms a step without drafting for the first
    ~800 steps (25-77 page faults a step, and the doubling copies), against 0.04 ms
    once grown. The host queue is now touched whole at its first hold
    (`DeferredContext(prefault=True)`): 16 MiB took 4.7 ms once (float32, the bundled
    pair's 2 KB rows: 8192 rows), so the budget is now 64 MiB (zeroing it: 40 ms once on an
    AVX2 EPYC). With a full queue compacted (`hold(live=...)`), rows are written while
    nothing drafts only when the live requests' own rows fill it: at 32 requests of ~100
    context tokens each, 16 MiB held about 100 steps, and each flush wrote ~40% of it."""
    if not on_host or row_bytes <= 0:
        return token_budget
    return max(token_budget, HOST_BYTES // row_bytes)


class ContextRows(NamedTuple):
    """Target features [n, L*D], positions [n] and cache slots [n] (-1 = skip) of context tokens.
    To `DeferredContext.hold`, features may also come as the L per-layer blocks [n, D]: they are
    copied side by side into the queue, never concatenated into a tensor of their own."""

    features: torch.Tensor | Sequence[torch.Tensor]
    positions: torch.Tensor
    slots: torch.Tensor


def joined(rows: ContextRows) -> ContextRows:
    """`rows` with its features as one [n, L*D] tensor."""
    if isinstance(rows.features, torch.Tensor):
        return rows
    return rows._replace(features=torch.cat(list(rows.features), dim=-1))


def _feature_blocks(features: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [features] if isinstance(features, torch.Tensor) else list(features)


def last_write_per_slot(slots: torch.Tensor) -> torch.Tensor:
    """`slots` with every slot that a later row writes again replaced by -1 (skipped)."""
    n = slots.shape[0]
    if n < 2:
        return slots
    unique, inverse = torch.unique(slots, return_inverse=True)
    if unique.shape[0] == n:
        return slots
    rows = torch.arange(n, device=slots.device)
    last = torch.full((unique.shape[0],), -1, dtype=rows.dtype, device=slots.device)
    last.scatter_reduce_(0, inverse, rows, reduce="amax")
    keep = torch.zeros(n, dtype=torch.bool, device=slots.device)
    keep[last] = True
    return torch.where(keep, slots, torch.full_like(slots, -1))


class DeferredContext:
    """The queue of held-back context rows; see the module docstring."""

    def __init__(self, max_rows: int, prefault: bool = False):
        """`prefault` (host memory): the first hold allocates all `max_rows` rows and touches
        them at once, so steps without drafting never pay first touches or doubling copies."""
        if max_rows < 1:
            raise ValueError(f"DeferredContext max_rows={max_rows} must be >= 1")
        self.max_rows = max_rows
        self.prefault = prefault
        self._buffers: ContextRows | None = None  # the rows' home: [capacity, ...] per field, reused
        # Host buffers' positions and slots as numpy views: a numpy row copy costs a fraction of a
        # tensor slice and copy_ (the hold runs once per step, between target forwards)
        self._host_index: tuple | None = None
        self._owners: list[tuple[int, list[str] | None]] = []  # per held batch: (rows, each row's request id)
        self._rows = 0
        self.dropped_rows = 0  # rows of finished requests never written (a count, for tests and profiles)
        # Held rows per request id over the first `_counted` held batches (`live_rows`), and rows held
        # without owners among them.
        self._owner_rows: Counter[str] = Counter()
        self._counted = 0
        self._unowned_rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def capacity(self) -> int:
        return 0 if self._buffers is None else self._buffers.slots.shape[0]

    def hold(self, rows: ContextRows, owners: list[str] | None = None, live: Container[str] | None = None) -> bool:
        """Copy `rows` into the queue (the runner reuses its buffers, the target its
        hidden states; `owners`: each row's request id, None when unknown: never
        dropped); False, queueing nothing, when the queue would pass `max_rows`:
        write now, with `take()`. With `live`, a full queue first drops the rows of
        requests no longer in it (`compact`) and holds on if that freed enough."""
        blocks = _feature_blocks(rows.features)
        n = blocks[0].shape[0]
        if rows.positions.dim() != 1:  # (M-RoPE positions: write now)
            return False
        if owners is not None and len(owners) != n:
            raise ValueError(f"DeferredContext.hold: {len(owners)} owners for {n} rows")
        if self._rows + n > self.max_rows:
            if live is None:
                return False
            self.compact(live)
            if self._rows + n > (1.0 - COMPACT_FREE_SHARE) * self.max_rows:
                return False
        self._append(blocks, rows.positions, rows.slots)
        self._owners.append((n, owners))
        return True

    def room_on_host(self, n: int) -> bool:
        """Whether `hold_on_host` of `n` rows would hold them now."""
        host, end = self._host_index, self._rows + n
        return host is not None and end <= self.max_rows and end <= host[0].shape[0]

    def hold_on_host(self, features: Sequence[torch.Tensor], positions: np.ndarray, slots: np.ndarray, n: int,
                     owners: list[str]) -> bool:
        """hold() of a plain-decode step's `n` rows into host buffers that have room for them
        (the first `n` rows of each per-layer block in `features`, `positions` and `slots`:
        numpy views of the runner's buffers), with only the copies; False, holding nothing,
        where hold() must decide (no host buffers yet, or too little room).

        On a coasting step this queue is most of the proposer's work, and between target
        forwards every Python statement and tensor op runs from cold caches: hold() there
        took ~45 us at 32 requests against ~5 us in a loop (float32, AVX-512 EPYC)."""
        start = self._rows
        end = start + n
        host = self._host_index
        if host is None or end > self.max_rows or end > host[0].shape[0]:
            return False
        self._put_rows(start, end, features if features[0].shape[0] == n else [h[:n] for h in features])
        host[0][start:end] = positions[:n]
        host[1][start:end] = slots[:n]
        self._owners.append((n, owners))
        self._rows = end
        return True

    def take(self, rows: ContextRows | None = None, live: Container[str] | None = None) -> ContextRows | None:
        """Everything queued followed by `rows`, as one batch to write now (None
        when both are empty); the queue is emptied. The batch may be a view of the
        queue's buffers: write it before the next `hold`. With `live`, queued rows
        whose request is not in it are dropped (see the module docstring)."""
        held, owners = self._rows, self._owners
        if held == 0:
            return None if rows is None else joined(rows)
        keep = self._live_mask(owners, live) if live is not None else None
        if rows is not None:
            self._append(_feature_blocks(rows.features), rows.positions, rows.slots)
        total = self._rows
        self._owners, self._rows = [], 0
        self._forget_counts()
        batch = ContextRows(*(t[:total] for t in self._buffers))
        if keep is not None:
            kept = int(keep.sum())
            self.dropped_rows += held - kept
            if kept + total - held == 0:
                return None
            if kept < held:
                index = torch.cat([torch.nonzero(keep).flatten(), torch.arange(held, total)])
                batch = ContextRows(*(t.index_select(0, index.to(t.device)) for t in batch))
        return batch._replace(slots=last_write_per_slot(batch.slots))

    def compact(self, live: Container[str]) -> int:
        """Drop the held rows of requests not in `live` now, the others kept in order (what
        `take(live=live)` would write is unchanged); returns the rows dropped."""
        if not self._rows:
            return 0
        flags = self._live_flags(self._owners, live)
        kept = sum(flags)
        dropped = self._rows - kept
        if dropped == 0:
            return 0
        index = torch.nonzero(torch.tensor(flags, dtype=torch.bool)).flatten()
        for buffer in self._buffers:
            buffer[:kept] = buffer[:self._rows].index_select(0, index.to(buffer.device))
        owners, row = [], 0
        for n, who in self._owners:
            mine, row = flags[row:row + n], row + n
            if who is None:
                owners.append((n, None))
            elif any(mine):
                still = [r for r, alive in zip(who, mine) if alive]
                owners.append((len(still), still))
        self._owners, self._rows = owners, kept
        self._forget_counts()
        self.dropped_rows += dropped
        return dropped

    def live_rows(self, live: Container[str] | None) -> int:
        """How many held rows a `take(live=live)` now would write (all of them without `live`).

        Counted per request, not per row: asked at every replan (the cost of switching drafting
        back on), a row-by-row pass over a full queue took ~1 ms at 64 requests (bfloat16, AVX-512
        EPYC), a third of a replan. The held batches are folded into per-request counts when asked
        (one C-level count per batch), so holding stays as cheap as before."""
        if live is None or not self._rows:
            return self._rows
        counts = self._owner_rows
        for n, who in self._owners[self._counted:]:
            if who is None:
                self._unowned_rows += n
            else:
                counts.update(who)
        self._counted = len(self._owners)
        return self._unowned_rows + sum(rows for req_id, rows in counts.items() if req_id in live)

    def _forget_counts(self) -> None:
        """The held rows changed other than by a hold: `live_rows` counts afresh."""
        self._owner_rows.clear()
        self._counted = self._unowned_rows = 0

    @staticmethod
    def _live_flags(owners: list[tuple[int, list[str] | None]], live: Container[str]) -> list[bool]:
        """Per held row, True where its request is live (or unknown)."""
        flags: list[bool] = []
        for n, who in owners:
            flags.extend([True] * n if who is None else [r in live for r in who])
        return flags

    @classmethod
    def _live_mask(cls, owners: list[tuple[int, list[str] | None]], live: Container[str]) -> torch.Tensor:
        """`_live_flags` as a [held rows] bool tensor."""
        return torch.tensor(cls._live_flags(owners, live), dtype=torch.bool)

    def _append(self, blocks: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        n, start = blocks[0].shape[0], self._rows
        self._reserve(start + n, blocks, positions, slots)
        features = self._buffers.features
        width = sum(block.shape[1] for block in blocks)
        if width != features.shape[1]:
            raise ValueError(f"DeferredContext: {width} feature columns held, the queue's rows have {features.shape[1]}")
        self._put_rows(start, start + n, blocks)
        host = self._host_index
        if host is not None and positions.device.type == "cpu" and slots.device.type == "cpu":
            host[0][start:start + n] = positions.numpy()
            host[1][start:start + n] = slots.numpy()
        else:
            self._buffers.positions[start:start + n].copy_(positions)
            self._buffers.slots[start:start + n].copy_(slots)
        self._rows = start + n

    def _put_rows(self, start: int, end: int, blocks: Sequence[torch.Tensor]) -> None:
        """The per-layer feature `blocks` side by side into queue rows start..end: one op into
        whole (contiguous) rows, not one strided copy per block."""
        rows = self._buffers.features[start:end]
        if len(blocks) == 1:
            rows.copy_(blocks[0])
        else:
            torch.cat(blocks, dim=1, out=rows)

    def _reserve(self, needed: int, blocks: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Buffers for `needed` rows, the rows held so far kept (capacity doubles: few allocations)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        width = sum(block.shape[1] for block in blocks)
        first = blocks[0]
        if self.prefault and self._buffers is None:
            capacity = max(capacity, self.max_rows)
            grown = ContextRows(first.new_zeros(capacity, width), positions.new_zeros(capacity),
                                slots.new_zeros(capacity))
        else:
            grown = ContextRows(first.new_empty(capacity, width), positions.new_empty(capacity),
                                slots.new_empty(capacity))
        if self._buffers is not None:
            for new, old in zip(grown, self._buffers):
                new[:self._rows].copy_(old[:self._rows])
        self._buffers = grown
        on_host = grown.positions.device.type == "cpu" and grown.slots.device.type == "cpu"
        self._host_index = (grown.positions.numpy(), grown.slots.numpy()) if on_host else None
