"""Where draft blocks start in a training sequence.

At inference the drafter's anchor is the last verified token: always a generated
(response) token, with the target's features available for every position before
it. So an anchor `a` lies in the response (a >= prompt_len) and its block must fit
in the sequence (a + B - 1 <= seq_len - 1, so every label is a real token).

`random` (DFlash's recipe) draws fresh distinct anchors every step, so over training
every response position is seen at every offset inside a block. `fixed` is the
ablation: anchors on the aligned grid prompt_len + k*B (the blocks tile the
response), a random subset of the grid when more blocks fit than a row holds.
"""

from __future__ import annotations

import torch

ANCHOR_MODES = ("random", "fixed")


def anchor_range(prompt_len: int, seq_len: int, block_size: int) -> tuple[int, int]:
    """Inclusive [low, high] of valid anchors; low > high when none fits."""
    return max(prompt_len, 1), seq_len - block_size


def num_valid_anchors(prompt_len: int, seq_len: int, block_size: int) -> int:
    low, high = anchor_range(prompt_len, seq_len, block_size)
    return max(high - low + 1, 0)


def sample_anchors(prompt_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
                   mode: str = "random", generator: torch.Generator | list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [batch, N] long, keep [batch, N] bool), anchors sorted within a row.

    N = min(num_blocks, the most candidates any row has). Rows with fewer
    candidates are padded with anchor 0 and keep=False (zero loss weight).
    `generator`: one for the whole batch, or a list with one per row (a row's
    anchors then do not depend on which other rows share its batch).
    """
    if mode not in ANCHOR_MODES:
        raise ValueError(f"anchors={mode!r}: choose one of {', '.join(ANCHOR_MODES)}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks}: need at least 1 block per sequence")
    generators = generator if isinstance(generator, list) else [generator] * len(prompt_lens)
    rows = []
    for prompt_len, seq_len, gen in zip(prompt_lens, seq_lens, generators, strict=True):
        low, high = anchor_range(prompt_len, seq_len, block_size)
        if low > high:
            raise ValueError(f"sequence of {seq_len} tokens with a {prompt_len}-token prompt has no "
                             f"room for a {block_size}-token block; filter it out (see data.usable)")
        step = 1 if mode == "random" else block_size
        candidates = torch.arange(low, high + 1, step)
        if len(candidates) > num_blocks:
            pick = torch.randperm(len(candidates), generator=gen)[:num_blocks]
            candidates = candidates[pick].sort().values
        rows.append(candidates)
    n = max(len(r) for r in rows)
    anchors = torch.zeros(len(rows), n, dtype=torch.long)
    keep = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, :len(r)] = r
        keep[i, :len(r)] = True
    return anchors, keep
