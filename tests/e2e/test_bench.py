"""`vllm-dflash bench`: metrics math, prompt loading, input validation, and one
tiny end-to-end run.

The end-to-end run uses the bundled trained pair (models/toy-target and
models/toy-draft) with k=7; modes none, dflash (the plugin, k every step),
dflash-adaptive (the plugin's adaptive speculation) and dflash-vllm
(in-tree), categories code, math and mixed, concurrency 1 and 2 (requests in
flight: the steps of plain decoding count them), eager float32 engines (bfloat16 verification
of k+1 tokens at once can flip near-ties; in float32 greedy outputs must equal
no speculation exactly). Validation tests use a tiny random pair. It checks that every figure is
present and consistent (acceptance length within [1, k+1], histogram and
mean agree exactly, speedup > 0, greedy outputs identical to no speculation),
that each mode ran the proposer it names, and that the plots are real PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from limits import HANG_GUARD_S

from vllm_dflash.bench import cli, metrics, prompts
from vllm_dflash.bench.runner import batches_for, cycled, in_flight, mode_env, speculative_config, warm_up_prompts
from serving_pairs import TOY_DRAFT, TOY_TARGET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- metrics math

@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(q)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        assert metrics.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_percentile_hand_values_and_errors():
    assert metrics.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert metrics.percentile([10.0, 20.0], 99) == pytest.approx(19.9)
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match="percentile q=101"):
        metrics.percentile([1.0], 101)


def test_acceptance_from_counters_exact_histogram():
    # 10 drafts of k=3 with accepted counts 0,0,0,1,1,2,3,3,3,3 (vLLM accepts a prefix).
    accepted = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    per_pos = [sum(a > i for a in accepted) for i in range(3)]
    c = metrics.SpecCounters(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=sum(accepted),
                             accepted_per_pos=per_pos)
    acc = metrics.acceptance(c)
    assert per_pos == [7, 5, 4]
    assert acc["length_histogram"] == [3, 2, 1, 4]  # acceptance lengths 1, 2, 3, 4
    assert acc["mean_length"] == pytest.approx(1 + 16 / 10)
    assert acc["draft_acceptance_rate"] == pytest.approx(16 / 30)
    assert acc["per_position_rate"] == [0.7, 0.5, 0.4]


def test_acceptance_rejects_inconsistent_counters():
    with pytest.raises(ValueError, match="sum to 5 but num_accepted_tokens is 6"):
        metrics.acceptance(metrics.SpecCounters(4, 12, 6, [3, 2, 0]))
    with pytest.raises(ValueError, match="not non-increasing"):
        metrics.acceptance(metrics.SpecCounters(4, 12, 5, [1, 4, 0]))
    assert metrics.acceptance(metrics.SpecCounters())["num_drafts"] == 0


def test_counters_from_vllm_metrics_and_delta():
    snap = lambda d, t, a, pos: [  # noqa: E731 - the shape of LLM.get_metrics() entries
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=d),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=t),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=a),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=pos),
        SimpleNamespace(name="vllm:generation_tokens", value=999),
    ]
    before = metrics.SpecCounters.from_metrics(snap(5, 15, 4, [3, 1, 0]))
    after = metrics.SpecCounters.from_metrics(snap(12, 36, 13, [7, 4, 2]))
    delta = after - before
    assert delta == metrics.SpecCounters(7, 21, 9, [4, 3, 2])
    assert delta + before == after
    assert metrics.SpecCounters.from_dict(delta.to_dict()) == delta


def test_per_request_acceptance():
    got = metrics.per_request([[2, 1, 1], [0, 0, 2]])
    assert got["per_request_mean_length"] == [1 + 3 / 4, 3.0]
    assert got["per_request_histogram_total"] == [2, 1, 3]
    reqs = [{"queued_ts": 0.0, "first_token_ts": 0.1, "last_token_ts": 0.5, "num_output_tokens": 5,
             "spec_histogram": h} for h in ([2, 1, 1], [0, 0, 2])]
    fig = metrics.summarize({"wall_s": 1.0, "prompt_tokens": 2, "output_tokens": 10, "requests": reqs,
                             "counters": metrics.SpecCounters(6, 12, 7, [4, 3]).to_dict()})
    assert fig["acceptance"]["length_histogram"] == [2, 1, 3]
    assert fig["acceptance"]["per_request_matches_counters"] is True


def test_request_timing_and_summary():
    reqs = [{"queued_ts": 0.0, "first_token_ts": 0.1, "last_token_ts": 1.1, "num_output_tokens": 11},
            {"queued_ts": 0.0, "first_token_ts": 0.2, "last_token_ts": 2.2, "num_output_tokens": 21}]
    t = metrics.request_timing(reqs)
    assert t["latency_p50_s"] == pytest.approx(1.65)
    assert t["latency_p99_s"] == pytest.approx(1.1 + 0.99 * 1.1)
    assert t["tpot_mean_ms"] == pytest.approx(100.0)
    assert t["request_tokens_per_s_p50"] == pytest.approx((10.0 + 21 / 2.2) / 2)
    fig = metrics.summarize({"wall_s": 2.0, "prompt_tokens": 8, "output_tokens": 32, "requests": reqs,
                             "counters": None, "step_s": 1.5, "draft_s": 0.5})
    assert fig["output_tokens_per_s"] == 16.0 and fig["total_tokens_per_s"] == 20.0
    assert fig["draft_fraction"] == pytest.approx(1 / 3) and fig["target_verify_s"] == 1.0
    with pytest.raises(ValueError, match="wall_s=0"):
        metrics.summarize({"wall_s": 0, "prompt_tokens": 0, "output_tokens": 0, "requests": []})


def test_merge_speedup_and_match():
    a = {"wall_s": 1.0, "prompt_tokens": 4, "output_tokens": 10, "requests": [], "concurrency": 1,
         "counters": metrics.SpecCounters(2, 6, 3, [2, 1, 0]).to_dict(), "step_s": 0.8, "draft_s": 0.2,
         "output_digests": ["x"]}
    b = {**a, "wall_s": 3.0, "output_tokens": 30, "counters": metrics.SpecCounters(1, 3, 1, [1, 0, 0]).to_dict(),
         "output_digests": ["y"]}
    m = metrics.merge([a, b])
    assert (m["wall_s"], m["output_tokens"], m["step_s"], m["draft_s"]) == (4.0, 40, 1.6, 0.4)
    assert m["counters"] == metrics.SpecCounters(3, 9, 4, [3, 1, 0]).to_dict()
    cells = [{"mode": "none", "category": "all", "concurrency": 1, "output_tokens_per_s": 10.0,
              "output_digests": ["x", "y"]},
             {"mode": "dflash", "category": "all", "concurrency": 1, "output_tokens_per_s": 25.0,
              "output_digests": ["x", "z"]},
             {"mode": "dflash", "category": "all", "concurrency": 4, "output_tokens_per_s": 5.0}]
    metrics.add_speedups(cells)
    metrics.match_rate(cells)
    assert cells[1]["speedup"] == 2.5 and cells[1]["outputs_match_none"] == 0.5
    assert math.isnan(cells[2]["speedup"]) and cells[2]["outputs_match_none"] is None


def test_mixed_category_interleaves_every_category():
    assert cli.interleave({"code": [[1], [2], [3]], "math": [[4]], "prose": [[5], [6]]}) == [
        [1], [4], [5], [2], [6], [3]]


def test_adaptive_summary_and_merge():
    from vllm_dflash.adaptive.stats import AdaptiveStats

    a = AdaptiveStats(3)
    a.record_step(3, np.array([3, 0]), "optimal")
    a.record_step(0, np.array([0, 0]), "warmup")
    a.record_outcomes(np.full((200, 3), 0.5), np.full(200, 3), np.r_[np.zeros(100, int), np.full(100, 3)])
    s = metrics.adaptive_summary(a.snapshot())
    assert (s["steps"], s["drafting_share"], s["mean_query"], s["mean_budget"]) == (2, 0.5, 1.5, 0.75)
    assert s["calibration"][0] == {"position": 1, "verified": 200, "predicted": 0.5, "realised": 0.5}
    assert s["calibration_max_error"] == pytest.approx(0.0)
    merged = metrics.merge([{"wall_s": 1.0, "prompt_tokens": 1, "output_tokens": 1, "requests": [],
                             "adaptive": a.snapshot()}] * 2)
    assert merged["adaptive"]["budget_hist"] == [6, 0, 0, 2]


def test_batches_cycle_prompts_to_full_batches():
    ps = [[1], [2], [3]]
    assert batches_for(ps, 2) == [[[1], [2]], [[3], [1]]]
    assert batches_for(ps, 4) == [[[1], [2], [3], [1]]]
    assert batches_for(ps, 1) == [[[1]], [[2]], [[3]]]


def test_in_flight_cells_hold_at_least_waves_times_c_requests():
    ps = [[1], [2], [3]]
    assert cycled(ps, 2, waves=3) == [[1], [2], [3], [1], [2], [3]]
    assert cycled(ps, 4, waves=1) == [[1], [2], [3], [1]]
    assert cycled(ps, 1, waves=2) == [[1], [2], [3]]  # already two waves of one


def test_in_flight_warm_up_holds_two_waves_of_c_requests():
    ps = [[i] for i in range(48)]
    assert warm_up_prompts(ps, 1) == [[0], [1]]
    assert warm_up_prompts(ps, 16) == ps[:32]
    assert warm_up_prompts(ps, 64) == ps + ps + ps[:32]


def test_in_flight_caps_the_scheduler_and_restores_it():
    scheduler = SimpleNamespace(max_num_running_reqs=64, max_num_active_reqs=64)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        engine_core=SimpleNamespace(scheduler=scheduler))))
    with in_flight(llm, 4):
        assert (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs) == (4, 4)
    assert (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs) == (64, 64)
    with pytest.raises(KeyError), in_flight(llm, 2):
        raise KeyError("a failing generate")
    assert (scheduler.max_num_running_reqs, scheduler.max_num_active_reqs) == (64, 64)
    with in_flight(llm, 128):  # never above what the engine was built for
        assert scheduler.max_num_running_reqs == 64
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0.*--batching waves"), \
            in_flight(SimpleNamespace(llm_engine=None), 2):
        pass


def test_modes_map_to_speculative_config_and_env():
    spec = {"draft": "/d", "eagle3_head": "/e", "num_spec_tokens": 7}
    assert speculative_config({**spec, "mode": "none"}) is None
    assert speculative_config({**spec, "mode": "none-control"}) is None  # the noise control: none again
    base = {"method": "dflash", "model": "/d", "num_speculative_tokens": 7}
    assert speculative_config({**spec, "mode": "dflash-vllm"}) == base
    assert speculative_config({**spec, "mode": "dflash"}) == {**base, "adaptive": False}
    assert speculative_config({**spec, "mode": "dflash-adaptive"}) == {**base, "adaptive": True}
    assert mode_env("dflash-adaptive") == {"VLLM_DFLASH_IMPL": None}
    assert speculative_config({**spec, "mode": "eagle3"})["model"] == "/e"
    assert mode_env("dflash-vllm") == {"VLLM_DFLASH_IMPL": "vllm"}
    assert mode_env("dflash") == {"VLLM_DFLASH_IMPL": None}
    with pytest.raises(ValueError, match="mode='medusa'"):
        speculative_config({**spec, "mode": "medusa"})


def test_draft_sample_sweep_maps_to_each_proposers_key():
    spec = {"draft": "/d", "num_spec_tokens": 7}
    assert speculative_config({**spec, "mode": "dflash", "draft_sample": "sample"})["draft_sample"] == "sample"
    in_tree = speculative_config({**spec, "mode": "dflash-vllm", "draft_sample": "sample"})
    assert in_tree["draft_sample_method"] == "probabilistic" and "draft_sample" not in in_tree
    assert speculative_config({**spec, "mode": "dflash-vllm", "draft_sample": "argmax"})[
        "draft_sample_method"] == "greedy"
    args = argparse.Namespace(modes=["none", "dflash", "ngram"], num_spec_tokens=[3, 7],
                              draft_sample=["argmax", "sample"])
    assert cli.plan(args) == [("none", None, None), ("dflash", 3, "argmax"), ("dflash", 3, "sample"),
                          ("dflash", 7, "argmax"), ("dflash", 7, "sample"), ("ngram", 3, None), ("ngram", 7, None)]
    assert cli.mode_label("dflash", "sample") == "dflash/sample" and cli.mode_label("dflash", None) == "dflash"


# ---------------------------------------------------------------- prompts

def test_prompt_files(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a", "category": "code"}\n\n{"prompt": "b", "category": "math"}\n'
                  '{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "c"}]}\n')
    assert prompts.load_prompt_sets(str(jl)) == {"code": ["a"], "math": ["b"], "default": ["c"]}
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert prompts.load_prompt_sets(str(txt)) == {"default": ["one", "two"]}
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
                              {"messages": [{"role": "user", "content": "yo"}]}]))
    assert prompts.load_prompt_sets(str(sg)) == {"default": ["hi", "yo"]}
    assert prompts.load_prompt_sets("toy", str(tmp_path)) == prompts.BUILTIN_PROMPTS
    (tmp_path / "eval_prompts.json").write_text(json.dumps({"code": ["x"], "prose": ["y", "z"]}))
    sets = prompts.load_prompt_sets("toy", str(tmp_path))
    assert prompts.select(sets, ["prose"], 1) == {"prose": ["y"]}


def test_prompt_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{nope\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        prompts.load_prompt_sets(str(bad))
    nop = tmp_path / "nop.jsonl"
    nop.write_text('{"answer": "a"}\n')
    with pytest.raises(ValueError, match=r'nop.jsonl:1: no prompt found; give a "prompt" string'):
        prompts.load_prompt_sets(str(nop))
    with pytest.raises(ValueError, match="no such file"):
        prompts.load_prompt_sets(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"--categories: \['poetry'\] not in the prompt set"):
        prompts.select({"code": ["a"]}, ["poetry"], None)


def test_byte_fallback_ids_stay_in_vocab():
    ids = prompts.byte_token_ids("héllo", vocab_size=64)
    assert len(ids) == len("héllo".encode()) and all(8 <= i < 64 for i in ids)


# ---------------------------------------------------------------- CLI validation

def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Tiny random target + 1-layer block-8 draft, correlated so some drafts are accepted."""
    from helpers import correlate_pair, random_draft, save_pair, tiny_target

    target = tiny_target(seed=0)
    draft = random_draft(target, num_layers=1, block_size=8, seed=1)
    correlate_pair(target, draft)
    return save_pair(target, draft, tmp_path_factory.mktemp("bench_pair"))


def test_validation_errors(tiny_pair, tmp_path):
    target, draft = tiny_pair
    base = ("--target", target, "--draft", draft, "--out", str(tmp_path))
    cases = [
        (("--modes", "none,medusa"), "--modes: unknown"),
        (("--modes", "none,eagle3"), "--eagle3-head: mode eagle3 needs"),
        (("--num-spec-tokens", "8"), r"--num-spec-tokens \[8\]: a DFlash draft with block_size 8"),
        (("--concurrency", "0,2"), "--concurrency='0,2': expected positive integers"),
        (("--max-tokens", "0"), "--max-tokens=0 must be >= 1"),
        (("--waves", "0"), "--waves=0 must be >= 1"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            cli.validate(_args(*base, *extra))
    with pytest.raises(ValueError, match="folder has no config.json"):
        cli.validate(_args("--target", str(tmp_path), "--draft", draft))
    args = cli.validate(_args(*base))
    assert args.num_spec_tokens == [7]  # block_size - 1 by default
    assert cli.base_spec(args, {"code": [[1, 2]]}, False)["waves"] == 1
    assert cli.base_spec(cli.validate(_args(*base, "--waves", "3")), {"code": [[1, 2]]}, False)["waves"] == 3
    args = cli.validate(_args(*base, "--modes", "none,dflash,dflash-adaptive,ngram", "--num-spec-tokens", "3,7"))
    assert cli.plan(args) == [("none", None, None), ("dflash", 3, None), ("dflash", 7, None),
                              ("dflash-adaptive", 7, None), ("ngram", 3, None), ("ngram", 7, None)]
    args = cli.validate(_args(*base, "--modes", "none,dflash-adaptive,none-control", "--num-spec-tokens", "3,7"))
    assert cli.plan(args) == [("none", None, None), ("dflash-adaptive", 7, None), ("none-control", None, None)]
    assert cli.validate(_args(*base, "--dtype", "float32,bfloat16")).dtypes == ["float32", "bfloat16"]
    with pytest.raises(ValueError, match="--dtype=float32,fp8: choose from auto, float32"):
        cli.validate(_args(*base, "--dtype", "float32,fp8"))
    with pytest.raises(ValueError, match="--draft-sample=top1: choose from argmax, sample"):
        cli.validate(_args(*base, "--draft-sample", "top1"))


def test_demo_runs_bench_none_vs_dflash_and_reports(tiny_pair):
    from vllm_dflash.bench import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    b = demo.bench_args(parser.parse_args(["--target", tiny_pair[0], "--draft", tiny_pair[1]]))
    b = cli.validate(b)
    assert (b.modes, b.concurrency, b.keep_outputs, b.enforce_eager, b.dtype) == (
        ["none", "dflash-adaptive"], [1], True, True, "float32")
    assert cli.plan(b) == [("none", None, None), ("dflash-adaptive", 7, None)]

    def cell(mode, cat, tps, tau=None):
        c = {"mode": mode, "category": cat, "concurrency": 1, "output_tokens_per_s": tps,
             "request_tokens_per_s_p50": tps}
        if tau:
            c["acceptance"] = {"mean_length": tau}
        return c
    results = [cell("none", "code", 100.0), cell("dflash-adaptive", "code", 250.0, 3.5),
               cell("none", "all", 100.0), cell("dflash-adaptive", "all", 250.0, 3.5)]
    metrics.add_speedups(results)
    doc = {"config": {"target": tiny_pair[0], "out": "o", "dtype": "bfloat16"}, "results": results,
           "runs": [{"mode": "dflash-adaptive", "num_spec_tokens": 7, "proposer": "vllm_dflash.x.P"}],
           "prompts": {"code": {"texts": ["write code"]}},
           "outputs": {"none": {"code": [[1, 2, 3], [4, 5]]}, "dflash-adaptive-k7": {"code": [[1, 2, 3], [4, 6]]}}}
    doc["environment"] = {"cpu_count": 2, "cuda": False, "loadavg_at_start": [0.5, 0, 0], "loadavg_at_end": [9.0, 0, 0]}
    text = demo.report(doc)
    assert "the machine was busy (1-min load average up to 9.0 on 2 CPUs)" in text
    assert "--- prompt (code): write code" in text and "[1, 2, 3]" in text
    assert "1/2 DFlash outputs are identical" in text and "earliest difference at token 1" in text
    assert "code" in text and "2.50x" in text and "3.50" in text


def test_resume_reuses_a_finished_mode_only_for_the_same_spec(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):  # a runner subprocess that fails at once
        calls.append((cmd, kwargs["env"]))
        return SimpleNamespace(returncode=3)

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    spec = {"mode": "dflash-vllm", "num_spec_tokens": 7, "threads": 1, "prompts": {"a": [[1, 2]]}}
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "dflash-vllm-k7.json").write_text(json.dumps(spec))
    (tmp_path / "specs" / "dflash-vllm-k7.result.json").write_text(json.dumps({"cells": []}))
    assert cli.launch(spec, str(tmp_path), timeout=60, profile=False, resume=True) == {"cells": []}
    assert calls == []
    # A changed spec is rerun, in the mode's environment, and the stale result is dropped.
    with pytest.raises(RuntimeError, match="mode dflash-vllm-k7 failed"):
        cli.launch({**spec, "prompts": {"a": [[3]]}}, str(tmp_path), timeout=60, profile=False, resume=True)
    assert not (tmp_path / "specs" / "dflash-vllm-k7.result.json").exists()
    (cmd, env), = calls
    assert cmd[1:3] == ["-m", "vllm_dflash.bench.runner"]
    assert (env["VLLM_DFLASH_IMPL"], env["OMP_NUM_THREADS"], env["NUMBA_NUM_THREADS"]) == ("vllm", "1", "1")


def test_interleaved_mode_that_fails_stops_the_others_with_its_log(tmp_path, monkeypatch):
    """--interleave: one engine dies, the one waiting for its turn is killed, and the
    error carries the failed mode's log tail (as a sequential run's does)."""
    def command(spec_path, result_path):
        if "none" in os.path.basename(spec_path):
            return [sys.executable, "-c", "import sys; print('engine exploded here'); sys.exit(3)"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(cli, "_runner_command", command)
    specs = [{"mode": m, "num_spec_tokens": k, "prompts": {"a": [[1]]}} for m, k in (("dflash", 3), ("none", None))]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)mode none failed \(exit 3\).*engine exploded here"):
        cli.launch_interleaved(specs, str(tmp_path), timeout=120, profile=False, turn_folder=str(tmp_path / "t"))
    assert time.monotonic() - start < 30  # the sleeping engine was not waited for


# ---------------------------------------------------------------- end to end

@pytest.mark.vllm
def test_bench_end_to_end(tmp_path):
    """The bundled trained pair (models/toy-target + models/toy-draft, B=16), k=7,
    static and adaptive, with the mixed-category workload."""
    target, draft = TOY_TARGET, TOY_DRAFT
    out = tmp_path / "bench"
    modes = ("none", "dflash", "dflash-adaptive", "dflash-vllm")
    cmd = [sys.executable, "-m", "vllm_dflash.cli", "bench", "--target", target, "--draft", draft,
           "--modes", ",".join(modes), "--concurrency", "1,2", "--num-prompts", "2", "--num-spec-tokens", "7",
           "--categories", "code,math", "--mixed", "--max-tokens", "24", "--ignore-eos", "--threads", "1",
           "--dtype", "float32", "--enforce-eager", "--draft-cost", "--draft-cost-blocks", "4,8", "--draft-cost-layers", "1,2",
           "--draft-cost-iters", "2", "--draft-cost-threads", "1", "--out", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "out tok/s" in proc.stdout and "dflash-vllm" in proc.stdout and "Adaptive speculation" in proc.stdout

    doc = json.loads((out / "results.json").read_text())
    proposers = {r["mode"]: r["proposer"] for r in doc["runs"]}
    assert proposers["none"] is None
    assert proposers["dflash"].startswith("vllm_dflash.") and proposers["dflash-adaptive"] == proposers["dflash"]
    assert proposers["dflash-vllm"] == "vllm.v1.spec_decode.dflash.DFlashProposer"
    machine = doc["environment"]["machine_info"]
    assert machine["cpu_model"] and "AVX2" in machine["isa"] and machine["cores"] >= 1 and machine["vllm"]

    cells = doc["results"]
    assert {(c["mode"], c["category"], c["concurrency"]) for c in cells} == {
        (m, cat, c) for m in modes for cat in ("code", "math", "mixed", "all") for c in (1, 2)}
    for c in cells:
        where = (c["mode"], c["category"], c["concurrency"])
        n_req = 2 if c["category"] in ("code", "math") else 4  # mixed: both categories interleaved; all: pooled
        assert c["num_requests"] == n_req and c["output_tokens"] == 24 * n_req, where
        assert c["output_tokens_per_s"] > 0 and c["total_tokens_per_s"] > c["output_tokens_per_s"], where
        assert 0 < c["time_per_output_token_ms"] and 0 < c["latency_p50_s"] <= c["latency_p99_s"], where
        assert c["speedup"] > 0 and c["speedup_p50"] > 0, where
        assert c["outputs_match_none"] == 1.0, where  # greedy DFlash is lossless, adaptive or not
        assert 0 < c["step_s"] <= c["wall_s"], where
        split = c["step_split_ms"]  # target forward, draft, verify and overhead partition a step
        assert split["target"] > 0 and split["verify"] > 0 and split["overhead"] >= 0, where
        assert sum(split[p] for p in ("target", "draft", "verify", "overhead")) == pytest.approx(split["step"])
        assert c["steps"] * split["step"] / 1e3 == pytest.approx(c["step_s"]), where
        if c["mode"] == "none":
            assert "acceptance" not in c and c["draft_s"] == 0.0, where
            # c requests in flight, one token per request and step: a cell of n requests takes
            # n / c * 24 steps (at c = 1 one request after the other, not all at once).
            assert c["steps"] == n_req // c["concurrency"] * 24, where
            continue
        assert ("adaptive" in c) == (c["mode"] == "dflash-adaptive"), where
        acc, k = c["acceptance"], c["num_spec_tokens"]
        assert k == 7, where
        if c["mode"] == "dflash-adaptive":
            a = c["adaptive"]
            assert a["steps"] > 0 and sum(a["query_hist"]) == a["steps"] and len(a["budget_hist"]) == k + 1, where
            if not acc["num_drafts"]:  # the controller may decide not to speculate at all here
                continue
        assert acc["num_drafts"] > 0, where
        assert 1.0 <= acc["mean_length"] <= k + 1, where
        hist = acc["length_histogram"]
        assert len(hist) == k + 1 and sum(hist) == acc["num_drafts"], where
        assert sum((j + 1) * h for j, h in enumerate(hist)) / sum(hist) == pytest.approx(acc["mean_length"])
        rates = acc["per_position_rate"]
        assert all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:])), where
        assert 0 < c["draft_fraction"] < 1, where
        # vLLM's per-request stats and its Prometheus counters are separate paths: they must agree.
        assert acc["per_request_matches_counters"] is True, where
        per_req = acc["per_request_mean_length"]
        assert all(1 <= t <= k + 1 for t in per_req), where
    dflash_all = [c for c in cells if c["mode"] == "dflash" and c["category"] == "all"]
    assert max(c["acceptance"]["mean_length"] for c in dflash_all) > 1.2  # trained pair: drafts accepted

    md = (out / "results.md").read_text()
    assert "| dflash-vllm | 7 | 2 |" in md and "| draft layers | B |" in md and "| mode | k | conc | steps |" in md
    assert "| dflash-adaptive | 7 | 1 |" in md and "drafting %" in md

    rows = doc["draft_cost"]["rows"]
    assert {(r["layers"], r["block_size"]) for r in rows} == {(1, 4), (1, 8), (2, 4), (2, 8)}
    assert all(r["dflash_ms"] > 0 and r["autoregressive_ms"] > 0 for r in rows)
    for name in ("speedup_vs_concurrency", "acceptance_histogram", "per_position_acceptance", "draft_cost",
                 "adaptive_budgets", "adaptive_calibration"):
        png = out / f"{name}.png"
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name


def test_interleaved_modes_take_turns_pass_by_pass(tmp_path):
    """--interleave --repeats 2: both engines alive at once, each pass over a cell of one
    mode measured right after the same pass of the other, never overlapping (vLLM's
    request timestamps are CLOCK_MONOTONIC, comparable across processes); a cell pools
    its two passes; greedy outputs still match."""
    out = tmp_path / "ilv"
    cmd = [sys.executable, "-m", "vllm_dflash.cli", "bench", "--target", TOY_TARGET, "--draft", TOY_DRAFT,
           "--modes", "none,dflash", "--num-spec-tokens", "3", "--concurrency", "1,2", "--num-prompts", "2",
           "--categories", "code,prose", "--max-tokens", "16", "--ignore-eos", "--threads", "1", "--dtype", "float32",
           "--enforce-eager", "--interleave", "--repeats", "2", "--no-plots", "--out", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for mode in ("none", "dflash-k3"):
        result = json.loads((out / "specs" / f"{mode}.result.json").read_text())
        passes = []
        for c in result["cells"]:
            assert len(c["requests"]) == 4 and c["output_tokens"] == 4 * 16  # 2 prompts, 2 passes, pooled
            passes += [c["requests"][:2], c["requests"][2:]]
        runs[mode] = [(min(r["queued_ts"] for r in p), max(r["last_token_ts"] for r in p)) for p in passes]
    spans = [span for pair in zip(runs["none"], runs["dflash-k3"]) for span in pair]  # none, dflash, none, ...
    assert len(spans) == 16
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    doc = json.loads((out / "results.json").read_text())
    assert all(c["outputs_match_none"] == 1.0 for c in doc["results"] if c["mode"] == "dflash")


def test_in_flight_warm_up_holds_c_requests_so_no_timed_cell_warms_adaptive_up(tmp_path):
    """--warmup with in-flight cells: at each concurrency the warm-up holds c requests in flight,
    as the cells do, even with fewer prompts than c (4 here, c = 8). Adaptive speculation's
    warm-up steps at that batch size fall in it, and no timed cell holds one. (One batch of the
    4 prompts never reached 8 requests: the first cell at 8 took the size's warm-up steps.)"""
    out = tmp_path / "warm"
    cmd = [sys.executable, "-m", "vllm_dflash.cli", "bench", "--target", TOY_TARGET, "--draft", TOY_DRAFT,
           "--modes", "dflash-adaptive", "--num-spec-tokens", "15", "--concurrency", "8", "--num-prompts", "2",
           "--categories", "code,prose", "--max-tokens", "32", "--threads", "1", "--dtype", "float32",
           "--enforce-eager", "--no-plots", "--out", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (spec_result,) = (out / "specs").glob("*.result.json")
    cells = json.loads(spec_result.read_text())["cells"]
    assert [c["category"] for c in cells] == ["code", "prose"]
    for c in cells:
        steps = c["adaptive"]["steps"]
        assert sum(steps.values()) > 0 and steps["warmup"] == 0, (c["category"], steps)
