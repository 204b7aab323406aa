"""Adaptive-speculation counters and their memory-mapped file."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dflash.adaptive import stats as st


def test_counters_and_calibration_rows():
    s = st.AdaptiveStats(4)
    s.record_step(4, np.array([0, 4, 2]), "optimal")
    s.record_step(0, np.array([0, 0, 0]), "warmup")
    s.record_step(0, 5, "optimal")  # a coasting step: five requests, no budgets
    s.record_outcomes(np.array([[0.9, 0.5, 0.0, 0.0], [0.8, 0.6, 0.4, 0.2]]), np.array([2, 4]), np.array([1, 3]))
    snap = s.snapshot()
    assert snap["steps"] == {"optimal": 2, "warmup": 1, "explore": 0, "probe": 0, "forced": 0, "off": 0}
    assert snap["query_hist"] == [2, 0, 0, 0, 1] and snap["budget_hist"] == [9, 0, 1, 0, 1]
    assert snap["verified_per_pos"] == [2, 2, 1, 1] and snap["accepted_per_pos"] == [2, 1, 1, 0]
    rows = st.calibration(snap)
    assert rows[0] == {"position": 1, "verified": 2, "predicted": pytest.approx(0.85), "realised": 1.0}
    assert rows[3]["predicted"] == pytest.approx(0.2) and rows[3]["realised"] == 0.0


def test_a_step_without_drafts_counts_as_record_step_counts_it():
    """record_no_drafts (a coasting step's three scalar updates) leaves what record_step(0, R,
    "optimal") leaves, in a memory-mapped file too."""
    fast, full = st.AdaptiveStats(5), st.AdaptiveStats(5)
    for requests in (1, 7, 64):
        fast.record_no_drafts(requests)
        full.record_step(0, requests, "optimal")
    fast.record_no_drafts(4, "forced")  # a forced schedule's pause coasts too
    full.record_step(0, 4, "forced")
    fast.record_step(3, np.array([1, 3]), "explore")
    full.record_step(3, np.array([1, 3]), "explore")
    assert fast.snapshot() == full.snapshot()
    assert fast.snapshot()["budget_hist"][0] == 76 and fast.snapshot()["steps"]["optimal"] == 3
    assert fast.snapshot()["steps"]["forced"] == 1


def test_one_row_outcomes_count_as_the_batched_ones():
    """Concurrency 1 takes a slice-update shortcut; it must count what the batched path counts."""
    rng = np.random.default_rng(0)
    one, batched = st.AdaptiveStats(6), st.AdaptiveStats(6)
    predicted = rng.random((40, 6))
    verified = rng.integers(0, 7, 40)
    accepted = np.minimum(rng.integers(0, 7, 40), verified)
    for i in range(40):
        one.record_outcomes(predicted[i:i + 1], verified[i:i + 1], accepted[i:i + 1])
    batched.record_outcomes(predicted[:20], verified[:20], accepted[:20])
    batched.record_outcomes(predicted[20:], verified[20:], accepted[20:])
    a, b = one.snapshot(), batched.snapshot()
    assert a["verified_per_pos"] == b["verified_per_pos"] and a["accepted_per_pos"] == b["accepted_per_pos"]
    assert np.allclose(a["predicted_per_pos"], b["predicted_per_pos"])
    assert sum(a["verified_per_pos"]) == int(verified.sum())


def test_memory_mapped_file_is_readable_by_another_reader(tmp_path):
    path = str(tmp_path / "stats" / "123-0.bin")
    writer = st.AdaptiveStats(3, path=path)
    writer.record_step(3, np.array([3]), "explore")
    assert st.read_stats(path)["budget_hist"] == [0, 0, 0, 1]
    writer.record_step(1, np.array([1]), "optimal")  # in place, no flush needed for readers of the page cache
    after = st.read_stats(path)
    assert after["budget_hist"] == [0, 1, 0, 1] and after["steps"]["explore"] == 1
    again = st.AdaptiveStats(3, path=path)  # a new engine in the same process starts from zero
    assert st.read_stats(path)["budget_hist"] == [0, 0, 0, 0]
    del again
    (tmp_path / "junk.bin").write_bytes(b"not stats")
    assert st.read_stats(str(tmp_path / "junk.bin")) is None
    assert st.read_stats(str(tmp_path / "missing.bin")) is None


def test_merge_and_difference():
    a, b = st.AdaptiveStats(2), st.AdaptiveStats(3)
    a.record_step(2, np.array([2, 1]), "optimal")
    b.record_step(3, np.array([3]), "optimal")
    merged = st.merge([a.snapshot(), b.snapshot()])
    assert merged["k"] == 3 and merged["budget_hist"] == [0, 1, 1, 1] and merged["steps"]["optimal"] == 2
    before = a.snapshot()
    a.record_step(0, np.array([0, 0]), "optimal")
    diff = st.difference(a.snapshot(), before)
    assert diff["budget_hist"] == [2, 0, 0] and diff["query_hist"] == [1, 0, 0] and diff["steps"]["optimal"] == 1
    assert st.merge([]) is None
