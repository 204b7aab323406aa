"""examples/ run as a user runs them (subprocesses, the venv's Python, defaults
unless the check needs them smaller):

* offline_inference.py: LLM(...).generate() with DFlash on the bundled pair;
* openai_client.py: a streaming chat against the shared "dflash" server of
  tests/serving/conftest.py (a real `vllm serve`), acceptance from /metrics;
* train_draft.sh: the toy training recipe, shrunk to a smoke run (8 prompts,
  3 steps, float32, no torch.compile), whose export must load as a z-lab draft.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from serving_pairs import REPO

pytestmark = pytest.mark.vllm

EXAMPLES = os.path.join(REPO, "examples")
TIMEOUT_S = 1200
ACCEPTANCE = re.compile(r"DFlash: (\d+) drafting steps, (\d+) (?:of \d+ )?draft tokens accepted, "
                        r"mean acceptance length ([\d.]+)")


def run(cmd: list[str], env: dict | None = None) -> str:
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env, cwd=REPO)
    assert proc.returncode == 0, f"{cmd[:2]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def acceptance(out: str) -> tuple[int, int, float]:
    match = ACCEPTANCE.search(out)
    assert match, out[-2000:]
    drafts, accepted, tau = int(match[1]), int(match[2]), float(match[3])
    assert drafts > 0 and 1.0 <= tau and tau == pytest.approx(1 + accepted / drafts, abs=0.01)
    return drafts, accepted, tau


def test_offline_inference_example():
    out = run([sys.executable, os.path.join(EXAMPLES, "offline_inference.py"), "--max-tokens", "32",
               "--max-model-len", "512", "--enforce-eager"])
    answers = re.findall(r"^>>> (.*)\n(.*)$", out, flags=re.M)
    assert len(answers) == 3 and all(a.strip() for _, a in answers), out[-2000:]
    acceptance(out)


def test_openai_client_example(toy_servers):
    out = run([sys.executable, os.path.join(EXAMPLES, "openai_client.py"), "--base-url", toy_servers["dflash"].url,
               "--max-tokens", "48"])
    assert out.strip().splitlines()[0].strip(), out  # the streamed answer
    acceptance(out)
    assert re.search(r"^48 tokens;", out, flags=re.M) or "tokens;" in out


def test_train_draft_example_smoke_run(tmp_path):
    out = run(["bash", os.path.join(EXAMPLES, "train_draft.sh"), str(tmp_path / "run")], env={
        "NUM_PROMPTS": "8", "MAX_NEW_TOKENS": "16", "MAX_LEN": "80", "STEPS": "3", "BATCH_SIZE": "4", "EVAL_NUM": "1",
        "EVAL_MAX_NEW_TOKENS": "16", "GEN_DTYPE": "float32", "GEN_EAGER": "1", "TARGET_DTYPE": "float32",
        "VLLM_DFLASH": os.path.join(os.path.dirname(sys.executable), "vllm-dflash")})
    export = tmp_path / "run" / "draft"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 16
    from vllm_dflash.reference import load_draft

    draft = load_draft(str(export))
    assert sum(p.numel() for p in draft.parameters()) > 0
    assert "tau" in out, out[-2000:]
