"""scripts/calibration_replay.py: recorded full-block drafts replayed through the acceptance chain offline."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys

import numpy as np

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "calibration_replay.py")


def load_script():
    spec = importlib.util.spec_from_file_location("calibration_replay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recorded_rows(n: int, k: int, seed: int) -> list:
    """Rows as scripts/adaptive_features.py records them: (kind, margin, top1, verified, accepted,
    request id, feature, prior), every block verified to the end. Each draft's positions are accepted
    with probability 0.9 times its confidence (the model's prior says the confidence itself, so the
    chain must learn the gap), requests of 40 drafts each."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        confidence = rng.uniform(0.5, 1.0, k)
        accepted = 0
        while accepted < k and rng.random() < 0.9 * confidence[accepted]:
            accepted += 1
        rows.append((0, confidence, confidence, k, accepted, f"req-{i // 40}", confidence, confidence))
    return rows


def test_a_replay_learns_a_biased_draft_and_counts_calibration_as_the_bench_does():
    """3000 synthetic drafts whose confidence overstates acceptance by 10% a position: what the
    chain hands out over the verified positions ends within 0.05 of what was realised at every
    position verified often (the bench's bar), shallow positions are verified more than deep ones,
    and tokens per unit of step time exceed one (a step yields its bonus token and some drafts)."""
    replay = load_script()
    from vllm_dflash.adaptive.calibration import SurvivalCorrection

    k = 8
    out = replay.replay(recorded_rows(3000, k, seed=0), SurvivalCorrection(k), verify_cost=0.05, k=k)
    often = out["verified"] >= 200
    assert often[:3].all() and np.all(np.diff(out["verified"]) <= 0), out["verified"]
    assert np.abs(out["error"][often]).max() < 0.05, out["error"]
    assert out["tokens_per_step_time"] > 1.0


def test_the_request_order_keeps_each_requests_rows_in_order():
    replay = load_script()
    rows = [(0, None, None, 1, 0, rid, None, None) for rid in ["a", "b", "a", "c", "b", "a"]]
    order = replay.ordered(rows, "requests")
    assert [r[5] for r in order] == ["a", "a", "a", "b", "b", "c"]
    assert replay.ordered(rows, "recorded") is rows


def test_the_command_line_replays_a_rows_file(tmp_path):
    path = tmp_path / "rows.pkl"
    with open(path, "wb") as f:
        pickle.dump(recorded_rows(200, 6, seed=1), f)
    run = subprocess.run([sys.executable, SCRIPT, str(path), "--kinds", "greedy", "--verify-cost", "0.05"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "greedy  requests verify cost 0.05" in run.stdout and "max |error|" in run.stdout


def test_bad_arguments_name_the_argument_and_the_fix(tmp_path):
    missing = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none.pkl")], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and "not found; record one with scripts/adaptive_features.py" in missing.stderr
    path = tmp_path / "rows.pkl"
    with open(path, "wb") as f:
        pickle.dump(recorded_rows(10, 4, seed=2), f)
    wrong = subprocess.run([sys.executable, SCRIPT, str(path), "--kinds", "greedy,beam"], capture_output=True,
                           text=True, timeout=300)
    assert wrong.returncode == 2 and "--kinds=greedy,beam: beam unknown" in wrong.stderr
