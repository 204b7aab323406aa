"""vllm_dflash.profiler: one set of phase names for engine steps and proposers,
the file the bench reads, and hook tables that still name real methods."""

from __future__ import annotations

import json
import time

import pytest

from vllm_dflash import profiler
from vllm_dflash.bench import metrics
from vllm_dflash.bench.runner import read_profile


class InTreeLikeModel:
    def combine_hidden_states(self, *a):
        time.sleep(0.001)

    def precompute_and_store_context_kv(self, *a):
        time.sleep(0.002)

    def __call__(self, *a):
        time.sleep(0.003)


class InTreeLikeProposer:
    """The method names vLLM's in-tree proposer has (PROPOSER_HOOKS["vllm"])."""

    def __init__(self):
        self.model = InTreeLikeModel()

    def set_inputs_first_pass(self, *a):
        time.sleep(0.001)

    def build_per_group_and_layer_attn_metadata(self, *a):
        return None, None

    def _sample_draft_tokens(self, *a):
        return "drafts"

    def propose(self, **kwargs):
        self.set_inputs_first_pass()
        self.model.combine_hidden_states()
        self.model.precompute_and_store_context_kv()
        self.build_per_group_and_layer_attn_metadata()
        self.model()
        time.sleep(0.001)
        return self._sample_draft_tokens()


def test_profile_file_is_what_the_bench_reads(tmp_path, monkeypatch):
    """VLLM_DFLASH_PROFILE_FILE: phases wrapped, rewritten after each call; 'other' is propose() outside them."""
    monkeypatch.delenv("VLLM_DFLASH_PROFILE_FILE", raising=False)
    assert profiler.install_from_env(InTreeLikeProposer()) is None  # off unless asked for
    path = tmp_path / "p.json"
    monkeypatch.setenv("VLLM_DFLASH_PROFILE_FILE", str(path))
    p = InTreeLikeProposer()
    profiler.install_from_env(p)
    assert p.propose() == "drafts" and p.propose() == "drafts"
    phases = read_profile(str(path))["phases"]
    assert {name: v["calls"] for name, v in phases.items()} == {
        "inputs": 2, "context_kv": 4, "attn_metadata": 2, "draft_forward": 2, "sample": 2, "propose": 2, "other": 2}
    named = sum(phases[n]["seconds"] for n in profiler.PROPOSE_PHASES)
    assert phases["draft_forward"]["seconds"] >= 0.006 and phases["other"]["seconds"] >= 0.002
    assert named + phases["other"]["seconds"] == pytest.approx(phases["propose"]["seconds"])


def test_calls_log_keeps_every_propose_call():
    timer = profiler.PhaseTimer(record_calls=True)
    p = InTreeLikeProposer()
    wrapped = profiler.time_proposer(p, timer)
    assert len(wrapped) == 6
    import torch

    p.propose(next_token_ids=torch.zeros(3))
    (call,) = timer.calls_log
    assert call["batch"] == 3 and call["context_kv"] >= 0.003 and call["propose"] >= sum(
        call[ph] for ph in profiler.PROPOSE_PHASES)


def test_engine_step_phases_and_the_bench_split():
    class Sampler:
        def forward(self, *a):
            time.sleep(0.001)

    class RejectionSampler:
        def __init__(self, sampler):
            self.sampler = sampler

        def forward(self, *a):
            self.sampler.forward()  # nested: verify counted once
            time.sleep(0.001)

    class Runner:
        def __init__(self):
            self.sampler = Sampler()
            self.rejection_sampler = RejectionSampler(self.sampler)

        def _model_forward(self):
            time.sleep(0.002)

        def execute_model(self):
            self._model_forward()

        def sample_tokens(self):
            self.rejection_sampler.forward()
            self.propose_draft_token_ids()

        def propose_draft_token_ids(self):
            time.sleep(0.001)

    runner, timer = Runner(), profiler.PhaseTimer()
    profiler.time_engine_steps(runner, timer)
    for _ in range(2):
        runner.execute_model()
        runner.sample_tokens()
    split = profiler.step_split(timer.phases)
    assert set(split) == set(metrics.TIMED_PARTS)
    assert split["steps"] == 2 and timer.calls("verify") == 2 and timer.calls("draft") == 2
    assert split["step_s"] >= split["target_s"] + split["draft_s"] + split["verify_s"] > 0


def test_delta_of_two_snapshots_and_merge(tmp_path):
    """The bench diffs cumulative timings around a measurement; the 'all' row pools categories."""
    path = tmp_path / "profile.json"
    assert read_profile(str(path)) is None
    path.write_text(json.dumps({"phases": {"draft_forward": {"calls": 3, "seconds": 0.3}}}))
    before = read_profile(str(path))["phases"]
    path.write_text(json.dumps({"phases": {"draft_forward": {"calls": 10, "seconds": 1.0},
                                           "context_kv": {"calls": 7, "seconds": 0.07}}}))
    delta = profiler.delta(before, read_profile(str(path))["phases"])
    assert delta["draft_forward"]["calls"] == 7 and delta["draft_forward"]["seconds"] == pytest.approx(0.7)
    assert delta["context_kv"] == {"calls": 7, "seconds": 0.07}
    assert profiler.delta(before, None) is None
    cell = {"wall_s": 1.0, "prompt_tokens": 1, "output_tokens": 1, "requests": [], "proposer_profile": delta}
    assert metrics.merge([cell, cell])["proposer_profile"]["draft_forward"]["calls"] == 14


def _hook_owner(path: str, drafter_cls, model_cls):
    head, name = path.split(".", 1)
    return {"drafter": drafter_cls, "model": model_cls}[head], name


@pytest.mark.parametrize("kind", sorted(profiler.PROPOSER_HOOKS))
def test_hook_tables_name_real_methods(kind):
    """A renamed method would silently drop out of the profile (missing hooks are skipped)."""
    import importlib

    if kind == "plugin":
        from vllm_dflash.serving.draft_model import DFlashDraftForCausalLM as model_cls
        from vllm_dflash.serving.proposer import DFlashProposer as drafter_cls
    else:
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as model_cls
        from vllm.v1.spec_decode.dflash import DFlashProposer as drafter_cls
    hooks = profiler.PROPOSER_HOOKS[kind]
    assert tuple(hooks) == profiler.PROPOSE_PHASES
    for paths in hooks.values():
        for path in paths:
            if path == "call:model":
                continue
            if path.startswith("module:"):
                module, attrs = path[len("module:"):].split(":")
                owner = importlib.import_module(module)
                for attr in attrs.split("."):
                    owner = getattr(owner, attr)
                continue
            owner, name = _hook_owner(path, drafter_cls, model_cls)
            assert hasattr(owner, name), f"{kind}: {path} no longer exists"
