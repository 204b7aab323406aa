"""choose()'s chain for a step of a few requests, in Python floats.

At one to four requests a drafted block is at most a few dozen (request,
position) pairs, and the chain from confidence to budgets (the shared model's
conditional acceptance, each request's shift, the survival product, the
per-position correction and its upper bound, the best total budget) is some
fifty numpy calls. Between target forwards numpy's dispatch runs cold: measured
in the engine at one request (float32, bundled pair), choose() took ~0.3 ms a
drafting step, against a step of ~5-10 ms. The same arithmetic on Python floats
is one warm loop. It computes what the numpy path computes, in the same order
of operations (`tests/unit/test_adaptive_few_requests.py` holds them equal), so
which path ran never changes a decision.
"""

from __future__ import annotations

import math

# The most (request, position) pairs this path takes: its cost grows with them
# and the numpy path's hardly does (at 4 requests x 15 positions both are ~0.1 ms).
MAX_PAIRS = 64


def few_requests_choice(kinds: list[int], feature: list[list[float]], prior: list[list[float]], tables,
                        num_bins: int, num_positions: int, shifts: list[float], scales: list[float],
                        upper: list[float], useful: list[int] | None, step_seconds: list[float],
                        draft_seconds: float) -> tuple[list, list, list, list[int], float]:
    """(shared, raw, survival, budgets, expected accepted drafts) of one step's drafts.

    `tables`: the acceptance model's (alpha, beta) per cell as lists; `shifts`:
    each request's logit shift (all zero: none applied, as `RequestOffsets.apply`);
    `scales` / `upper`: the correction's factors on each position's odds against, at its
    shift and at the shift's upper bound (`SurvivalCorrection.scale_lists`); `useful`: the
    most drafts each request can still use (None: any); `step_seconds`: E over
    B = 0..R*q verified positions. The budgets are the best B's pairs, ranked by
    the corrected upper-bound survival (position order on ties)."""
    alpha, beta = tables
    shifted = any(shifts)
    top = num_bins - 1
    shared, raw, survival, flat = [], [], [], []
    for i, row in enumerate(feature):
        base = kinds[i] * num_bins
        scale = math.exp(-shifts[i]) if shifted else 1.0
        limit = len(row) if useful is None else useful[i]
        shared_row, raw_row, survival_row = [], [], []
        # Corrected survival: the product of the conditionals shifted by the correction, each
        # conditional taken back from the raw product as `calibration.conditionals_of` does.
        product, kept, bound = 1.0, 1.0, 1.0
        for j, (f, p) in enumerate(zip(row, prior[i])):
            b = int(f * num_bins) if f == f else 0  # NaN: numpy's cast lands below 0, clipped to 0
            cell = (base + (0 if b < 0 else top if b > top else b)) * num_positions + j
            s = alpha[cell] + beta[cell] * p
            shared_row.append(s)
            if shifted:
                c = 1e-6 if s < 1e-6 else 1 - 1e-6 if s > 1 - 1e-6 else s
                s = 1.0 / (1.0 + (1.0 - c) / c * scale)
            before = product
            product *= s
            raw_row.append(product)
            c = product / before if before > 0 else 0.0
            c = 1e-6 if c < 1e-6 else 1 - 1e-6 if c > 1 - 1e-6 else c
            odds = (1.0 - c) / c
            kept *= 1.0 / (1.0 + odds * scales[j])
            bound *= 1.0 / (1.0 + odds * upper[j])
            survival_row.append(kept)
            flat.append(bound if j < limit else 0.0)
        shared.append(shared_row)
        raw.append(raw_row)
        survival.append(survival_row)
    requests = len(feature)
    width = len(feature[0]) if requests else 0
    # Ranked best first, position order on ties (a stable sort); one request's are in order already.
    order = range(len(flat)) if requests == 1 else sorted(range(len(flat)), key=flat.__getitem__, reverse=True)
    best, best_value, gain = 0, requests / (step_seconds[0] + draft_seconds), 0.0
    for n, pair in enumerate(order, 1):
        gain += flat[pair]
        value = (requests + gain) / (step_seconds[n] + draft_seconds)
        if value > best_value:
            best, best_value = n, value
    budgets = [0] * requests
    if requests == 1:
        budgets[0] = best
    else:
        for pair in order[:best]:
            budgets[pair // width] += 1
    if useful is not None:
        budgets = [min(b, u, width) for b, u in zip(budgets, useful)]
    expected = 0.0
    for row, b in zip(survival, budgets):
        if b:
            expected += sum(row[:b])
    return shared, raw, survival, budgets, expected
