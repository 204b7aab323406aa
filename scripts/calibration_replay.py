"""Replay recorded drafts through adaptive speculation's acceptance chain offline: the bench's calibration check in seconds.

    python scripts/adaptive_features.py --num-prompts 16 --max-tokens 256 --out runs/feat/big.json   # records rows
    python scripts/calibration_replay.py runs/feat/big.json.rows.pkl --order requests --verify-cost 0.1

The bench's check (per position: predicted survival against the acceptance realised, over the
positions actually verified, averaged over the run) needs a 45-minute bench to move. Every row
`adaptive_features.py` records is a full block verified to the end, so any budget can be replayed
on it: the acceptance model, each request's shift and the per-position correction predict, a budget
is chosen as `choose()` chooses it (the corrected upper bounds, `best_budget` over a step time that
grows by `--verify-cost` steps per verified position, plus a draft costing 0.3 of a step), only the
verified part is learned from, and the calibration of what was handed out is counted as the bench
counts it. `--order requests` replays one request after another in recorded order (the bench's cells
run one kind of text at a time; the rows were recorded interleaved), `recorded` as they came.
`--compare MODULE` also replays another `SurvivalCorrection` (a file path), for a before/after.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import pickle
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_dflash.adaptive.calibration import (GREEDY, KIND_NAMES, SAMPLED, AcceptanceModel,  # noqa: E402
                                              RequestOffsets, SurvivalCorrection)
from vllm_dflash.adaptive.controller import best_budget  # noqa: E402

DRAFT_COST = 0.3  # a draft forward, in plain steps
WARMUP_ROWS = 16  # rows verified at random first, as the controller's warm-up does
EXPLORE_SHARE = 0.02  # then this share of rows verified at random (exploration)
KINDS = dict(zip(KIND_NAMES, (GREEDY, SAMPLED)))  # the rows' request kinds by name


def replay(rows: list, correction, verify_cost: float, k: int, seed: int = 0) -> dict:
    """Per-position calibration of the survival handed out on `rows` and tokens per unit of step time."""
    rng = np.random.default_rng(seed)
    model, offsets = AcceptanceModel(k), RequestOffsets()
    step = 1.0 + verify_cost * np.arange(k + 1)
    predicted, realised, verified_count = np.zeros(k), np.zeros(k), np.zeros(k)
    tokens = seconds = 0.0
    positions = np.arange(k)
    # (a correction from before this tree's learned also from what it handed out)
    hands_back = "applied" in inspect.signature(correction.update).parameters
    for i, (kind, _margin, _top1, length, accepted, req_id, feature, prior) in enumerate(rows):
        kinds = np.array([kind])
        shared = model.conditional(kinds, feature[None, :k], prior[None, :k])
        raw = np.cumprod(offsets.apply([req_id], shared), axis=1)
        survival = correction.apply(raw)
        if i < WARMUP_ROWS or rng.random() < EXPLORE_SHARE:
            budget = k if rng.random() < 0.5 else int(rng.integers(0, k + 1))
        else:
            budget, _, _ = best_budget(correction.apply(raw, optimistic=True), 1, step + DRAFT_COST)
        budget = min(budget, int(length))
        got = min(int(accepted), budget)
        verified = positions < budget
        hit = positions < got
        predicted[verified] += survival[0][verified]
        realised[verified] += hit[verified]
        verified_count[verified] += 1
        tokens += 1 + got
        seconds += step[budget] + DRAFT_COST
        model.update(kinds, feature[None, :k], np.array([budget]), np.array([got]))
        if hands_back:
            correction.update(raw, np.array([budget]), np.array([got]), applied=survival)
        else:
            correction.update(raw, np.array([budget]), np.array([got]))
        offsets.update([req_id], shared, (positions < min(got + 1, budget))[None, :], hit[None, :])
    n = np.maximum(verified_count, 1)
    return {"error": (predicted - realised) / n, "verified": verified_count, "tokens_per_step_time": tokens / seconds}


def load_correction_class(path: str):
    spec = importlib.util.spec_from_file_location("compared_calibration", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SurvivalCorrection


def ordered(rows: list, order: str) -> list:
    if order == "recorded":
        return rows
    first = {}
    for i, row in enumerate(rows):
        first.setdefault(row[5], i)
    return sorted(rows, key=lambda row: first[row[5]])  # stable: each request's rows stay in order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", help="OUT.rows.pkl written by scripts/adaptive_features.py")
    p.add_argument("--order", choices=("requests", "recorded"), default="requests")
    p.add_argument("--verify-cost", type=float, nargs="+", default=[0.02, 0.1],
                   help="a verified position's cost in plain steps (several: one replay each)")
    p.add_argument("--kinds", default="greedy,sampled")
    p.add_argument("--compare", default=None, help="a calibration.py whose SurvivalCorrection to replay as well")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    kind_names = args.kinds.split(",")
    unknown = [name for name in kind_names if name not in KINDS]
    if unknown:
        p.error(f"--kinds={args.kinds}: {', '.join(unknown)} unknown; give a comma-separated subset of "
                f"{','.join(KINDS)}")
    if not os.path.isfile(args.rows):
        p.error(f"rows file {args.rows!r} not found; record one with scripts/adaptive_features.py "
                "(it writes OUT.rows.pkl)")
    with open(args.rows, "rb") as f:
        rows = pickle.load(f)
    if not rows:
        raise SystemExit(f"{args.rows}: no rows")
    k = len(rows[0][6])
    corrections = {"this tree": SurvivalCorrection}
    if args.compare:
        corrections[os.path.basename(args.compare)] = load_correction_class(args.compare)
    for kind_name in kind_names:
        kind = KINDS[kind_name]
        chosen = ordered([r for r in rows if r[0] == kind], args.order)
        for cost in args.verify_cost:
            for name, cls in corrections.items():
                out = replay(chosen, cls(k), cost, k, args.seed)
                err = out["error"]
                print(f"{kind_name:7s} {args.order} verify cost {cost:g}  {name:20s} tokens/step-time "
                      f"{out['tokens_per_step_time']:.3f}  max |error| {np.abs(err).max():.3f}  "
                      f"predicted - realised: {' '.join(f'{e:+.2f}' for e in err)}", flush=True)


if __name__ == "__main__":
    main()
