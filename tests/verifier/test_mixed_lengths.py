"""Rows with different draft lengths in one batch (0 included), as adaptive speculation verifies them.

Request r drafts L_r = r mod 3 tokens (0, 1 or 2) from Q; its target rows are
P[0..L_r] (the last one the bonus). Whatever L_r, the first emitted token
must follow P[0]: chi-square goodness of fit per length group, N = 60,000
rows per group, ALPHA = 1e-3. A row with no draft emits exactly one token,
its bonus. Power: P[1] (the law an off-by-one row index would give) differs
from P[0] by sum (p-q)^2/q = 1.05, so at N = 60,000 a mixed-up row index is
rejected with p far below 1e-100; `test_row_mixup_is_detected` checks it.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from vllm_dflash.verifier import rejection_sample

V = 8
P = torch.tensor([
    [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.00],
    [0.05, 0.05, 0.10, 0.30, 0.20, 0.10, 0.10, 0.10],
    [0.125] * 8,
    [0.40, 0.20, 0.10, 0.10, 0.05, 0.05, 0.05, 0.05],
])
Q = torch.tensor([
    [0.05, 0.10, 0.30, 0.20, 0.05, 0.10, 0.05, 0.15],
    [0.30, 0.05, 0.05, 0.20, 0.20, 0.10, 0.10, 0.00],
])
GROUP = 60_000
ALPHA = 1e-3


def verify_mixed(impl: str, seed: int, target_for=lambda length: P[: length + 1]):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.arange(3 * GROUP) % 3
    drafts, draft_probs, target = [], [], []
    for length in range(3):
        n = int((lengths == length).sum())
        for j in range(length):
            drafts.append((torch.multinomial(Q[j], n, replacement=True, generator=gen), j, length))
    # Interleave per request: drafts, their q, then target rows (drafts + bonus).
    by_request: list[list[int]] = [[] for _ in range(len(lengths))]
    for tokens, _, length in drafts:
        rows = (lengths == length).nonzero().squeeze(1)
        for r, t in zip(rows.tolist(), tokens.tolist()):
            by_request[r].append(t)
    for r, length in enumerate(lengths.tolist()):
        draft_probs.extend(Q[j] for j in range(length))
        target.append(target_for(length))
    flat = torch.tensor([t for ds in by_request for t in ds], dtype=torch.int32)
    cu = torch.cumsum(lengths, 0).to(torch.int32)
    uniforms = torch.rand(flat.numel(), dtype=torch.float64, generator=gen)
    noise = torch.empty(len(lengths), V).exponential_(generator=gen)
    out = rejection_sample(flat, cu, torch.cat(target), torch.stack(draft_probs), None,
                           torch.zeros(len(lengths), dtype=torch.bool), uniforms, noise, 2, impl=impl)
    return lengths, out


def first_token_fit(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(chi-square p-value over the tokens the target emits, count of tokens it never emits)."""
    counts = torch.bincount(tokens, minlength=V).double()
    possible = probs > 0
    probs = probs.double()
    expected = probs[possible] / probs[possible].sum() * counts[possible].sum()
    return float(stats.chisquare(counts[possible].numpy(), expected.numpy()).pvalue), int(counts[~possible].sum())


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_every_draft_length_keeps_the_first_token_law(request, impl):
    if impl == "native":
        request.getfixturevalue("native_cpu")
    lengths, out = verify_mixed(impl, seed=7)
    emitted = (out != -1).sum(1)
    assert (emitted[lengths == 0] == 1).all(), "a request without drafts emits its bonus token only"
    assert (emitted <= lengths + 1).all() and (emitted >= 1).all()
    for length in range(3):
        p, impossible = first_token_fit(out[lengths == length, 0].long(), P[0])
        assert impossible == 0, f"rows with {length} drafts emitted a token the target never emits"
        assert p > ALPHA, f"rows with {length} drafts: first token off the target law (p={p:.2e})"


def test_row_mixup_is_detected():
    """The same test rejects a batch whose rows are shifted by one position (bonus row of P[1])."""
    lengths, out = verify_mixed("reference", seed=7, target_for=lambda length: P[1: length + 2])
    p, impossible = first_token_fit(out[lengths == 0, 0].long(), P[0])
    assert p < 1e-100 and impossible > 0
