"""The acceptance length a drafter will get in decoding, estimated on cached sequences.

Greedy speculative decoding of a cached (target-generated, greedy) response is
a chain: the first block is anchored on the first response token (the prefill
emits it), a block anchored at `a` emits its run of correct drafts `s(a)` plus
the target's bonus token, and the next block is anchored at `a + s(a) + 1`.
So tau = tokens / rounds follows from the run at every anchor: one batched,
teacher-forced draft pass per sequence gives `s(a)` for all anchors, and walking
the chain gives the rounds decoding would take.

The mean of `1 + s(a)` over random anchors (what a training batch shows) is
not that number: decoding spends few rounds where drafts run long (repetitive
text) and many where they fail, so the uniform mean overstates tau, by 2x on
targets whose responses mix the two. That mean stays in the logs as
`block_tau`; the estimate the trainer reports as `tau_est` is the chain's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Context-length buckets of the tau-by-context reports: [0, 256), [256, 1024), [1024, inf).
BUCKET_EDGES = (256, 1024)


def bucket_name(context_len: int, edges: Sequence[int] = BUCKET_EDGES) -> str:
    low = 0
    for edge in edges:
        if context_len < edge:
            return f"{low}-{edge}"
        low = edge
    return f"{low}+"


def bucket_names(edges: Sequence[int] = BUCKET_EDGES) -> list[str]:
    return [bucket_name(e - 1, edges) for e in edges] + [bucket_name(edges[-1], edges)]


def runs_from_hits(hits: torch.Tensor) -> torch.Tensor:
    """[..., B-1] bool (draft k correct and a real token) -> [...] run of correct drafts from position 1."""
    return hits.long().cumprod(-1).sum(-1)


def decode_chain(runs: Sequence[int], prompt_len: int, seq_len: int) -> list[tuple[int, int]]:
    """(anchor, tokens emitted) per round of greedy decoding of one cached sequence.

    runs[a - prompt_len] = run of correct drafts of the block anchored at a, for
    every a in [prompt_len, seq_len - 2]. Emission stops at the sequence's end
    (its stop token or length cap), as the decoding loop's does.
    """
    rounds, a, last = [], prompt_len, seq_len - 1
    while a < last:
        emitted = min(int(runs[a - prompt_len]) + 1, last - a)
        rounds.append((a, emitted))
        a += emitted
    return rounds


@torch.no_grad()
def sequence_runs(block_forward, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                  tokens: torch.Tensor, prompt_len: int, features: torch.Tensor, block_size: int,
                  chunk: int = 32) -> torch.Tensor:
    """Run of correct greedy drafts at every anchor in [prompt_len, len - 2] of one sequence.

    Blocks that reach past the sequence's end only count drafts of real tokens.
    `block_forward(embed_weight, tokens, features, anchors) -> hidden [1, N, B, D]`
    is the trainer's packed block forward, so the numbers come from the very
    computation the loss trains.
    """
    n, bs = len(tokens), block_size
    device = embed_weight.device
    padded = torch.zeros(1, n + bs, dtype=torch.long, device=device)
    padded[0, :n] = tokens.to(device)
    # Padding past the end is never attended (a block sees context before its anchor only).
    feats = F.pad(features.to(device), (0, 0, 0, bs))[None]
    anchors_all = torch.arange(prompt_len, n - 1, device=device)
    offsets = torch.arange(1, bs, device=device)
    out = []
    for start in range(0, len(anchors_all), chunk):
        anchors = anchors_all[start:start + chunk][None]
        hidden = block_forward(embed_weight, padded, feats, anchors)
        logits = F.linear(hidden[:, :, 1:].float(), lm_head_weight)
        label_pos = anchors[..., None] + offsets
        labels = torch.gather(padded, 1, label_pos.flatten(1)).view(label_pos.shape)
        hits = (logits.argmax(-1) == labels) & (label_pos < n)
        out.append(runs_from_hits(hits)[0].cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class ChainTau:
    """Tokens and rounds pooled over sequences, overall and by context-length bucket."""

    def __init__(self, edges: Sequence[int] = BUCKET_EDGES):
        self.edges = tuple(edges)
        self.tokens = {name: 0 for name in bucket_names(self.edges)}
        self.rounds = dict.fromkeys(self.tokens, 0)

    def add(self, rounds: list[tuple[int, int]]) -> None:
        for anchor, emitted in rounds:
            name = bucket_name(anchor, self.edges)
            self.tokens[name] += emitted
            self.rounds[name] += 1

    def as_tensor(self) -> torch.Tensor:
        """[2, buckets] float64 (tokens; rounds): what ranks sum before `from_tensor`."""
        return torch.tensor([list(self.tokens.values()), list(self.rounds.values())], dtype=torch.float64)

    def from_tensor(self, t: torch.Tensor) -> ChainTau:
        for i, name in enumerate(self.tokens):
            self.tokens[name], self.rounds[name] = int(t[0, i]), int(t[1, i])
        return self

    def summary(self) -> dict:
        tokens, rounds = sum(self.tokens.values()), sum(self.rounds.values())
        return {"tau_est": tokens / rounds if rounds else float("nan"),
                "tau_est_by_context": {name: {"tau": self.tokens[name] / r if r else None, "rounds": r}
                                       for name, r in self.rounds.items()}}
