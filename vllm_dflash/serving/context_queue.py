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
as `HOST_BYTES` hold); a step that would overflow writes the queue and itself
at once.

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

from collections.abc import Container
from typing import NamedTuple

import torch


HOST_BYTES = 128 << 20


def max_held_rows(token_budget: int, row_bytes: int, on_host: bool) -> int:
    """How many context rows may wait. A flush writes the rows of every request still
    running; the longer the queue, the more rows belong to requests that finished before
    it filled and are never written. On an accelerator the queue takes memory vLLM did
    not profile for, so it stays at one step's worth (`token_budget`). In host memory
    (CPU inference) `HOST_BYTES` of features may wait: measured on the bundled pair at 64
    requests, flushing a token budget's worth of rows every 64 steps was 1.7% of the
    step time of a step without drafting (3.6 us a row, most rows still live)."""
    if not on_host or row_bytes <= 0:
        return token_budget
    return max(token_budget, HOST_BYTES // row_bytes)


class ContextRows(NamedTuple):
    """Target features [n, L*D], positions [n] and cache slots [n] (-1 = skip) of context tokens."""

    features: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


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

    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"DeferredContext max_rows={max_rows} must be >= 1")
        self.max_rows = max_rows
        self._queued: list[ContextRows] = []
        self._owners: list[list[str] | None] = []  # per queued batch: each row's request id (None: unknown)
        self._rows = 0
        self.dropped_rows = 0  # rows of finished requests never written (a count, for tests and profiles)

    @property
    def rows(self) -> int:
        return self._rows

    def hold(self, rows: ContextRows, features_owned: bool = False, owners: list[str] | None = None) -> bool:
        """Queue a copy of `rows` (the runner reuses its buffers; `features_owned`: the
        features are a tensor nobody else holds, queued as they are; `owners`: each
        row's request id, None when unknown: never dropped); False, queueing nothing,
        when the queue would pass `max_rows`: write now, with `take()`."""
        n = rows.features.shape[0]
        if self._rows + n > self.max_rows or rows.positions.dim() != 1:  # (M-RoPE positions: write now)
            return False
        if owners is not None and len(owners) != n:
            raise ValueError(f"DeferredContext.hold: {len(owners)} owners for {n} rows")
        features = rows.features if features_owned else rows.features.clone()
        self._queued.append(ContextRows(features, rows.positions.clone(), rows.slots.clone()))
        self._owners.append(owners)
        self._rows += n
        return True

    def take(self, rows: ContextRows | None = None, live: Container[str] | None = None) -> ContextRows | None:
        """Everything queued followed by `rows`, as one batch to write now (None
        when both are empty); the queue is emptied. With `live`, queued rows whose
        request is not in it are dropped (see the module docstring)."""
        queued, owners = self._queued, self._owners
        self._queued, self._owners, self._rows = [], [], 0
        if live is not None:
            queued = [kept for part, who in zip(queued, owners) if (kept := self._live_rows(part, who, live))]
        batch = queued + ([rows] if rows is not None else [])
        if not batch:
            return None
        if len(batch) == 1:
            return batch[0]
        features, positions, slots = (torch.cat(parts) for parts in zip(*batch))
        return ContextRows(features, positions, last_write_per_slot(slots))

    def _live_rows(self, part: ContextRows, owners: list[str] | None, live: Container[str]) -> ContextRows | None:
        """The rows of `part` whose request is live (all of them when owners are unknown)."""
        if owners is None:
            return part
        keep = [r in live for r in owners]
        if all(keep):
            return part
        self.dropped_rows += keep.count(False)
        if not any(keep):
            return None
        index = torch.tensor([i for i, k in enumerate(keep) if k], device=part.slots.device)
        return ContextRows(*(t.index_select(0, index) for t in part))
