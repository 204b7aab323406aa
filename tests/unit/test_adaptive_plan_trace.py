"""VLLM_DFLASH_ADAPTIVE_TRACE: the controller's replans and off-plan steps as JSON lines."""

import json
import os
import types

import numpy as np
import pytest
from test_adaptive_realized import K, _controller_drafting_at_8

from vllm_dflash.adaptive.controller import OPTIMAL, PROBE
from vllm_dflash.adaptive.plan_trace import PlanTrace
from vllm_dflash.serving.proposer import DFlashProposer


def test_the_trace_holds_every_replan_and_off_plan_step_and_changes_no_decision():
    """Close curves at 8 requests (probes every ~32 decisions): every probe step and every
    replan is a record, a steady step of the cached plan is not; the plans are the same
    with and without the trace (same seed)."""
    traced, ids, kinds = _controller_drafting_at_8(slope=0.3)
    plain, _, _ = _controller_drafting_at_8(slope=0.3)
    records = []
    traced.trace = records.append
    plans = [traced.plan(ids, kinds) for _ in range(400)]
    assert [(p.q, p.reason) for p in plans] == [(p.q, p.reason) for p in (plain.plan(ids, kinds) for _ in range(400))]
    probes = sum(p.reason == PROBE for p in plans)
    assert probes > 0 and sum(r["reason"] == PROBE for r in records) == probes
    replans = [r for r in records if "values" in r]
    assert replans and replans[0]["decision"] == 1 and len(replans) < 400 - probes
    first = replans[0]
    assert len(first["values"]) == K + 1 and first["planned_q"] == plans[0].q > 0 and first["verdict"] == 0
    assert first["requests"] == 8 and first["probe"] is True and len(first["arms"]) == 2
    assert all(r["reason"] != OPTIMAL or "values" in r for r in records)  # no record of a plain cached step


def test_plan_trace_appends_json_lines_and_the_proposer_wires_it(tmp_path, monkeypatch):
    path = tmp_path / "plans.jsonl"
    trace = PlanTrace(str(path))
    trace({"decision": 1, "q": 3})
    trace({"decision": 2, "q": 0})
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["decision"], r["q"]) for r in lines] == [(1, 3), (2, 0)]
    assert all(r["time"] > 0 and r["pid"] == os.getpid() for r in lines)

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(seed=0),
                                   scheduler_config=types.SimpleNamespace(max_num_seqs=4))
    proposer = types.SimpleNamespace(num_speculative_tokens=K)
    monkeypatch.delenv("VLLM_DFLASH_ADAPTIVE_TRACE", raising=False)
    monkeypatch.delenv("VLLM_DFLASH_ADAPTIVE_SCHEDULE", raising=False)
    assert DFlashProposer._build_adaptive(proposer, config, None, tp_rank=1).controller.trace is None
    monkeypatch.setenv("VLLM_DFLASH_ADAPTIVE_TRACE", str(path))
    rank1 = DFlashProposer._build_adaptive(proposer, config, None, tp_rank=1).controller
    assert isinstance(rank1.trace, PlanTrace) and rank1.trace.path == f"{path}.rank1"
    rank1.plan(["a"], np.zeros(1, dtype=np.int64))  # warm-up: a step of reason "warmup"
    assert json.loads((tmp_path / "plans.jsonl.rank1").read_text())["reason"] == "warmup"
    # A path that cannot be written fails when the engine is built, naming the variable and the fix.
    monkeypatch.setenv("VLLM_DFLASH_ADAPTIVE_TRACE", str(tmp_path / "missing" / "plans.jsonl"))
    with pytest.raises(ValueError, match=r"VLLM_DFLASH_ADAPTIVE_TRACE=.*missing.*give a writable file path"):
        DFlashProposer._build_adaptive(proposer, config, None, tp_rank=0)
