"""ContextWriteCost: the per-row seconds a switch to drafting is priced at."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dflash.adaptive.write_cost import ContextWriteCost

# (rows, ms) of the context writes of one in-flight run, in order (bundled pair, float32, 8 requests,
# Zen 4 EPYC): a drafting step's own handful of rows at 0.26-0.64 ms, and now and then a flush of the
# rows held while nothing was drafted.
MEASURED_WRITES = [
    (17, 0.557), (8, 0.413), (17, 0.443), (10, 0.405), (12, 0.468), (9, 0.38), (12, 0.373), (12, 0.404),
    (13, 0.485), (31, 0.634), (26, 0.537), (215, 1.914), (9, 0.388), (11, 0.604), (10, 0.345), (13, 0.476),
    (10, 0.327), (12, 0.385), (13, 0.337), (960, 6.114), (23, 0.515), (38, 0.64), (20, 0.489), (10, 0.383),
    (34, 0.602), (15, 0.427), (7, 0.339), (2, 0.393), (5, 0.304), (12, 0.46), (1, 0.311), (1, 0.305),
    (4, 0.332), (9, 0.371), (5, 0.303), (2, 0.361), (1, 0.277), (8, 0.28), (3, 0.339), (1390, 8.747),
]


def test_the_measured_writes_price_a_flush_at_what_it_took():
    """Fitted on the writes before it, the flush of 1,390 held rows is priced within 25% of the
    8.7 ms it took (the fixed part is the drafting step's own); the mean seconds per row of the
    recent writes, which priced it before, put it at over 3x that."""
    cost, recent = ContextWriteCost(), None  # recent: the old price, each write's seconds per row averaged in
    for rows, ms in MEASURED_WRITES[:-1]:
        cost.add(rows, ms * 1e-3)
        recent = ms * 1e-3 / rows if recent is None else 0.5 * (recent + ms * 1e-3 / rows)
    flush_rows, flush_ms = MEASURED_WRITES[-1]
    priced = flush_rows * cost.per_row()
    assert priced == pytest.approx(flush_ms * 1e-3, rel=0.25)
    assert flush_rows * recent > 3 * flush_ms * 1e-3


def test_the_fit_recovers_a_known_fixed_and_per_row_cost():
    """0.3 ms a write plus 6 us a row, +-5% noise, sizes from 1 to 2,000 rows: the slope within 5%."""
    rng = np.random.default_rng(0)
    cost = ContextWriteCost()
    for rows in np.exp(rng.uniform(0.0, np.log(2000.0), 400)).astype(int) + 1:
        cost.add(int(rows), (3e-4 + 6e-6 * rows) * rng.uniform(0.95, 1.05))
    assert cost.per_row() == pytest.approx(6e-6, rel=0.05)


def test_nothing_to_price_before_a_write_and_one_size_gives_the_mean_per_row():
    cost = ContextWriteCost()
    assert cost.per_row() is None
    cost.add(0, 1e-3)  # an empty write (every row dropped) says nothing
    cost.add(4, -1.0)  # nor does a clock that went backwards
    assert cost.per_row() is None
    for _ in range(3):
        cost.add(4, 8e-3)
    assert cost.per_row() == pytest.approx(2e-3)  # one size cannot split the parts: 8 ms / 4 rows


def test_no_room_for_a_fixed_part_fits_through_the_origin():
    """Writes of 1 row in 0 s and 10 rows in 20 ms: the straight line through them has a
    negative fixed part, so the per-row cost is the fit through the origin, 0.2 / 101 s
    (nothing forgotten yet at this memory)."""
    cost = ContextWriteCost(memory=1e12)
    cost.add(1, 0.0)
    cost.add(10, 20e-3)
    assert cost.per_row() == pytest.approx(0.2 / 101)


def test_older_writes_are_forgotten():
    """The machine got busier (or the draft slower): after as many writes again at 12 us a
    row, the slope follows within 5%."""
    cost = ContextWriteCost(memory=64)
    sizes = [1, 10, 100, 1000]
    for i in range(400):
        cost.add(sizes[i % 4], 3e-4 + 6e-6 * sizes[i % 4])
    assert cost.per_row() == pytest.approx(6e-6)
    for i in range(400):
        cost.add(sizes[i % 4], 3e-4 + 12e-6 * sizes[i % 4])
    assert cost.per_row() == pytest.approx(12e-6, rel=0.05)
    with pytest.raises(ValueError, match="memory >= 1"):
        ContextWriteCost(memory=0.5)
