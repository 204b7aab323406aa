"""The plugin is found through vLLM's entry point and register() runs inside
vLLM's engine-core/worker processes, cheaply and idempotently."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
from limits import HANG_GUARD_S

import vllm_dflash


def _fresh_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    by_name = {ep.name: ep.value for ep in eps}
    assert by_name.get("dflash") == "vllm_dflash:register", by_name


def test_import_is_light():
    heavy = _fresh_python(
        "import sys, vllm_dflash; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch','vllm','numba','llvmlite','transformers'}))"
    )
    assert heavy == "[]", f"`import vllm_dflash` pulled in {heavy}"


def test_register_is_idempotent_and_avoids_numba():
    result = _fresh_python(
        "import sys, vllm_dflash; vllm_dflash.register(); vllm_dflash.register(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'numba','llvmlite'}))"
    )
    assert result == "[]", f"register() imported {result}: numba/llvmlite at plugin load crash CPU workers"


def _worker_pid(worker) -> int:
    import os as _os

    return _os.getpid()


@pytest.mark.vllm
def test_register_runs_in_vllm_worker(tmp_path, monkeypatch):
    from helpers import save_target, tiny_target

    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    monkeypatch.setenv("VLLM_DFLASH_REGISTER_MARKER_DIR", str(marker_dir))
    # collective_rpc ships _worker_pid to the worker by pickle.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    target_dir = save_target(tiny_target(), tmp_path / "target")

    from engines import vllm_engine

    with vllm_engine(in_process=False, model=target_dir, skip_tokenizer_init=True, dtype="float32",
                     enforce_eager=True, max_model_len=256, max_num_seqs=4) as llm:
        worker_pids = llm.collective_rpc(_worker_pid)
    assert worker_pids and all(pid != os.getpid() for pid in worker_pids)
    registered = {int(p.name.split(".")[1]): p.read_text() for p in marker_dir.iterdir()}
    for pid in worker_pids:
        assert registered.get(pid) == vllm_dflash.__version__, (
            f"register() did not run in worker pid {pid}; markers: {registered}"
        )


def test_a_step_without_drafts_hands_the_scheduler_nothing():
    """The take_draft_token_ids patch: the very lists propose_unverified_step returned
    (all empty) give None, so vLLM's post-step skips the scheduler's per-request update;
    any other draft lists, even equal ones, go to the scheduler as vLLM hands them."""
    from types import SimpleNamespace

    vllm_dflash.register()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    empty = [[], []]
    runner = SimpleNamespace(num_spec_tokens=15, _draft_token_req_ids=["a", "b"], _draft_token_ids=empty,
                             input_batch=SimpleNamespace(req_ids=["a", "b"]),
                             drafter=SimpleNamespace(handed_no_drafts=empty))
    runner._get_draft_token_ids_cpu = lambda: GPUModelRunner._get_draft_token_ids_cpu(runner)
    assert GPUModelRunner.take_draft_token_ids(runner) is None
    runner._draft_token_ids = [[], []]  # equal, but not the lists the proposer handed out as none
    taken = GPUModelRunner.take_draft_token_ids(runner)
    assert taken.req_ids == ["a", "b"] and taken.draft_token_ids == [[], []]
    runner._draft_token_ids, runner.drafter = [[5], []], SimpleNamespace(handed_no_drafts=None)
    assert GPUModelRunner.take_draft_token_ids(runner).draft_token_ids == [[5], []]
