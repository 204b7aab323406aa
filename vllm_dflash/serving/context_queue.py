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

At most `max_rows` rows wait (the engine's token budget per step: what a
single step's features already occupy); a step that would overflow writes
the queue and itself at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    def hold(self, rows: ContextRows, features_owned: bool = False) -> bool:
        """Queue a copy of `rows` (the runner reuses its buffers; `features_owned`: the
        features are a tensor nobody else holds, queued as they are); False, queueing
        nothing, when the queue would pass `max_rows`: write now, with `take()`."""
        n = rows.features.shape[0]
        if self._rows + n > self.max_rows or rows.positions.dim() != 1:  # (M-RoPE positions: write now)
            return False
        features = rows.features if features_owned else rows.features.clone()
        self._queued.append(ContextRows(features, rows.positions.clone(), rows.slots.clone()))
        self._rows += n
        return True

    def take(self, rows: ContextRows | None = None) -> ContextRows | None:
        """Everything queued followed by `rows`, as one batch to write now (None
        when both are empty); the queue is emptied."""
        batch = self._queued + ([rows] if rows is not None else [])
        self._queued, self._rows = [], 0
        if not batch:
            return None
        if len(batch) == 1:
            return batch[0]
        features, positions, slots = (torch.cat(parts) for parts in zip(*batch))
        return ContextRows(features, positions, last_write_per_slot(slots))
