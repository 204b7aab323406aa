"""Load and fault suite: real `vllm serve` DFlash servers under concurrent traffic.

Servers: tests/serving/conftest.py (the toy pair, float32). Traffic: tests/traffic.py.

* Load: CONCURRENCY streaming clients send NUM_REQUESTS requests to the
  default-settings DFlash server, mixing greedy chat and completions, seeded
  T=1, top-p, top-k, min-p, stop strings, n=2, logprobs, max_tokens=1,
  requests that end exactly at max_model_len, and long greedy answers; about a
  quarter of the streams are cancelled after 2-4 chunks. Every other request
  must be answered in full (outputs lost = 0), each kind as asked.
* After the load: greedy outputs (before, during and after it) equal the
  no-speculation server's; running / waiting requests and KV usage are back
  to 0; /health is OK; the spec-decode counters are consistent (accepted <=
  drafted, per-position counts non-increasing; nothing assumes k drafts per
  step, so per-request variable draft lengths pass too); no traceback in the
  server log.
* Bad input: every bad request gets a 4xx whose message names the problem,
  within a bounded time, and the server keeps serving.
* Preemption: the same kind of load on the tiny-KV, small-budget DFlash server,
  then a burst of long greedy answers that cannot all fit its KV cache
  (preemption and recompute forced whatever the drafts, counted in /metrics),
  keeps greedy outputs exact.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from serving_pairs import spec_metrics_from_prometheus, toy_prompts
from traffic import (
    LOGPROBS,
    STOP,
    TO_MAX_LEN_NEW_TOKENS,
    Request,
    build_mix,
    completion_prompts,
    long_prompt_ids,
    run_load,
    streaming_body,
    without_cancel,
)
from vllm_server import SERVED_NAME, SMALL_KV_BLOCK_SIZE, SMALL_KV_BLOCKS, SMALL_MAX_MODEL_LEN, gauge

pytestmark = [pytest.mark.vllm, pytest.mark.load]

NUM_REQUESTS = 128
CONCURRENCY = 64
NUM_PREEMPT_REQUESTS = 64
DEFAULT_MAX_MODEL_LEN = 2048  # the toy target's max_position_embeddings: vLLM's default
IDLE_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 600


def mix(num_requests: int, max_model_len: int):
    return build_mix(num_requests, toy_prompts(16), completion_prompts(16), long_prompt_ids(max_model_len),
                     max_model_len)


BURST_REQUESTS = 8  # the tiny-KV server's --max-num-seqs: all run at once
BURST_PROMPT_LEN = 32
BURST_NEW_TOKENS = 256


def preempt_burst() -> list[Request]:
    """Long greedy answers that cannot all fit the tiny KV cache, whatever the drafts.

    Eight requests of 32 + 256 tokens need 72 blocks of 32 against 24, and all
    eight are admitted at once (their prompts fit): decoding must preempt. The
    mix alone preempts only when drafts reserve enough slots, which the
    adaptive policy decides from timing."""
    need = BURST_REQUESTS * -(-(BURST_PROMPT_LEN + BURST_NEW_TOKENS) // SMALL_KV_BLOCK_SIZE)
    assert need > 2 * SMALL_KV_BLOCKS and BURST_PROMPT_LEN + BURST_NEW_TOKENS <= SMALL_MAX_MODEL_LEN
    ids = long_prompt_ids(BURST_PROMPT_LEN + BURST_REQUESTS)
    return [Request(1000 + i, "greedy_long", "completion",
                    streaming_body(prompt=ids[i:i + BURST_PROMPT_LEN], max_tokens=BURST_NEW_TOKENS, ignore_eos=True))
            for i in range(BURST_REQUESTS)]


def probes():
    """Greedy requests sent alone before and after the load."""
    return [r for r in without_cancel(mix(24, DEFAULT_MAX_MODEL_LEN)) if r.kind in ("greedy_chat", "greedy_completion")]


def key(request) -> str:
    return json.dumps(request.body, sort_keys=True)


def wait_idle(server) -> dict:
    """Poll /metrics until no request runs or waits and the KV cache is empty; the last values."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        text = server.metrics_text()
        values = {name: gauge(text, name) for name in
                  ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(1.0)


def summary(results) -> dict:
    cancelled = sum(r.cancelled for r in results)
    lost = [r for r in results if not r.cancelled and not r.complete]
    return {"requests": len(results), "cancelled": cancelled, "completed": sum(r.complete for r in results),
            "lost": len(lost), "statuses": sorted({r.status for r in results})}


@pytest.fixture(scope="module")
def dflash_load(toy_servers):
    server = toy_servers["dflash"]
    requests = mix(NUM_REQUESTS, DEFAULT_MAX_MODEL_LEN)
    before = run_load(server.url, probes(), 8, REQUEST_TIMEOUT_S)
    metrics_before = server.metrics_text()
    start = time.monotonic()
    results = run_load(server.url, requests, CONCURRENCY, REQUEST_TIMEOUT_S)
    wall = time.monotonic() - start
    idle = wait_idle(server)
    after = run_load(server.url, probes(), 8, REQUEST_TIMEOUT_S)
    out = {"results": results, "before": before, "after": after, "idle": idle, "wall_s": wall,
           "metrics_before": metrics_before, "metrics_after": server.metrics_text()}
    print(f"\n[load] dflash server: {summary(results)} in {wall:.1f} s, idle after: {idle}")
    return out


@pytest.fixture(scope="module")
def preempt_load(toy_servers):
    server = toy_servers["dflash_small"]
    requests = mix(NUM_PREEMPT_REQUESTS, SMALL_MAX_MODEL_LEN)
    metrics_before = server.metrics_text()
    start = time.monotonic()
    results = run_load(server.url, requests, CONCURRENCY, REQUEST_TIMEOUT_S)
    results += run_load(server.url, preempt_burst(), BURST_REQUESTS, REQUEST_TIMEOUT_S)
    wall = time.monotonic() - start
    idle = wait_idle(server)
    out = {"results": results, "idle": idle, "wall_s": wall, "metrics_before": metrics_before,
           "metrics_after": server.metrics_text()}
    print(f"\n[load] tiny-KV dflash server: {summary(results)} in {wall:.1f} s, idle after: {idle}")
    return out


@pytest.fixture(scope="module")
def references(toy_servers):
    """Greedy answers of the no-speculation server to every greedy request of both mixes and the probes."""
    greedy = [r for r in without_cancel(mix(NUM_REQUESTS, DEFAULT_MAX_MODEL_LEN) + mix(NUM_PREEMPT_REQUESTS,
                                                                                         SMALL_MAX_MODEL_LEN))
              if r.greedy] + probes() + preempt_burst()
    unique = list({key(r): r for r in greedy}.values())
    results = run_load(toy_servers["plain"].url, unique, 16, REQUEST_TIMEOUT_S)
    failed = [(r.request.kind, r.status, r.error) for r in results if not r.complete]
    assert not failed, f"the no-speculation server failed reference requests: {failed[:5]}"
    return {key(r.request): r for r in results}


def check_served_as_asked(results) -> None:
    """Every request answered in full unless cancelled, each kind as asked."""
    for r in results:
        if r.cancelled:
            assert r.status == 200 and r.chunks == r.request.cancel_after, (r.request.kind, r.status, r.error)
            continue
        body, kind = r.request.body, r.request.kind
        assert r.complete, (kind, r.request.index, r.status, r.error, r.finish, r.usage)
        assert set(r.finish.values()) <= {"stop", "length"}, (kind, r.finish)
        tokens = r.usage["completion_tokens"]
        n = body.get("n", 1)
        assert 1 <= tokens <= n * body["max_tokens"], (kind, r.usage)
        if kind in ("max_tokens_1", "to_max_model_len", "greedy_long"):  # run to max_tokens
            assert r.finish == {0: "length"} and tokens == body["max_tokens"], (kind, r.finish, r.usage)
        if kind == "to_max_model_len":
            assert r.usage["prompt_tokens"] + tokens == len(body["prompt"]) + TO_MAX_LEN_NEW_TOKENS
        if kind == "n2":
            assert sorted(r.texts) == [0, 1] or tokens < 2 * body["max_tokens"], r.texts
        if kind == "stop":
            assert not any(s in r.text() for s in STOP), r.text()
        if kind == "logprobs":
            assert r.logprob_tokens[0] and all(c >= LOGPROBS for c in r.logprob_tokens[0]), r.logprob_tokens
            assert len(r.logprob_tokens[0]) == tokens


def test_load_is_served_in_full(dflash_load):
    results = dflash_load["results"]
    stats = summary(results)
    assert stats["requests"] >= 128 and stats["lost"] == 0, stats
    assert stats["statuses"] == [200], stats
    assert 0.2 * len(results) <= stats["cancelled"] <= 0.3 * len(results), stats
    assert {r.request.kind for r in results if not r.cancelled} == {r.request.kind for r in results}
    check_served_as_asked(results)


def test_greedy_outputs_equal_no_speculation_before_during_after(dflash_load, references):
    served = [r for r in dflash_load["results"] if r.request.greedy and not r.cancelled]
    assert len(served) >= len(dflash_load["results"]) // 3  # the check covers a good part of the load
    served += dflash_load["before"] + dflash_load["after"]
    for r in served:
        ref = references[key(r.request)]
        assert r.answer() == ref.answer(), (r.request.kind, r.request.index, r.text(), ref.text())


def test_server_is_idle_and_healthy_after_load(toy_servers, dflash_load):
    assert dflash_load["idle"] == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                   "vllm:kv_cache_usage_perc": 0}
    assert toy_servers["dflash"].get("/health")[0] == 200


def check_spec_counters(before: str, after: str) -> dict:
    """Spec-decode counter increments, checked for consistency without assuming
    a fixed number of drafts per step."""
    from serving_pairs import PER_POS, delta

    m = delta(spec_metrics_from_prometheus(after), spec_metrics_from_prometheus(before))
    drafts, drafted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    accepted, per_pos = m["vllm:spec_decode_num_accepted_tokens"], m[PER_POS]
    assert drafts > 0 and 0 <= accepted <= drafted, m
    assert sum(per_pos) == accepted and per_pos[0] <= drafts, m
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), f"per-position counts must not increase: {per_pos}"
    assert all(c == 0 for c in per_pos[15:]), m  # at most k = 15 positions
    return m


def test_spec_decode_counters_are_consistent(dflash_load):
    m = check_spec_counters(dflash_load["metrics_before"], dflash_load["metrics_after"])
    drafts = m["vllm:spec_decode_num_drafts"]
    print(f"\n[load] spec decode: {m}, mean acceptance length {1 + m['vllm:spec_decode_num_accepted_tokens'] / drafts:.2f}")


# --------------------------------------------------------------- bad input ----

def _post(server, path: str, body, timeout: float = 60) -> tuple[int, str]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "def add(a, b):", "max_tokens": 8, **fields}


def _chat(**fields) -> dict:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, **fields}


# (name, path, body, words of which one must appear in the error message)
BAD_INPUTS = [
    ("negative_max_tokens", "/v1/completions", _completion(max_tokens=-1), ["max_tokens"]),
    ("negative_max_tokens_chat", "/v1/chat/completions", _chat(max_tokens=-5), ["max_tokens", "max_completion_tokens"]),
    ("negative_temperature", "/v1/completions", _completion(temperature=-0.5), ["temperature"]),
    ("non_numeric_temperature", "/v1/chat/completions", _chat(temperature="hot"), ["temperature"]),
    ("prompt_longer_than_context", "/v1/completions", _completion(prompt=[5] * (DEFAULT_MAX_MODEL_LEN + 8)),
     ["context length", "max_model_len", "maximum"]),
    ("unknown_model", "/v1/completions", _completion(model="no-such-model"), ["model"]),
    ("malformed_json", "/v1/completions", '{"model": "toy", "prompt": "hi", ', ["json", "JSON", "decode"]),
    ("huge_n", "/v1/completions", _completion(n=100000), ["n"]),
    ("out_of_vocabulary_token_id", "/v1/completions", _completion(prompt=[1, 2, 10**7]), ["vocab", "token"]),
    ("empty_prompt", "/v1/completions", _completion(prompt=""), ["empty", "prompt"]),
    ("empty_token_prompt", "/v1/completions", _completion(prompt=[]), ["empty", "prompt"]),
    ("empty_messages", "/v1/chat/completions", _chat(messages=[]), ["messages", "empty"]),
    ("top_p_out_of_range", "/v1/completions", _completion(top_p=1.5), ["top_p"]),
    # vLLM's own message also names min_p, which vllm-dflash's verifier supports (patches: _validate_spec_decode).
    ("logit_bias_with_dflash", "/v1/completions", _completion(logit_bias={"5": 10}),
     ["logit_bias is not supported with DFlash"]),
]


@pytest.mark.parametrize("name,path,body,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_4xx_naming_the_problem(toy_servers, name, path, body, words):
    server = toy_servers["dflash"]
    status, text = _post(server, path, body)
    assert 400 <= status < 500, f"{name}: HTTP {status}: {text[:500]}"
    message = text
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    assert any(w in message for w in words), f"{name}: HTTP {status}, message does not name {words}: {message[:500]}"
    assert "Traceback" not in message


def test_max_tokens_past_the_context_is_cut_to_it(toy_servers):
    """Not an error in vLLM: a prompt that leaves 4 tokens of context gets 4 tokens (finish "length")."""
    status, text = _post(toy_servers["dflash"], "/v1/completions",
                         _completion(prompt=[5] * (DEFAULT_MAX_MODEL_LEN - 4), max_tokens=64, ignore_eos=True))
    body = json.loads(text)
    assert status == 200 and body["usage"]["completion_tokens"] == 4, text[:500]
    assert body["choices"][0]["finish_reason"] == "length"


def test_server_still_serves_after_bad_inputs(toy_servers, references):
    server = toy_servers["dflash"]
    assert server.get("/health")[0] == 200
    results = run_load(server.url, probes()[:4], 4, REQUEST_TIMEOUT_S)
    for r in results:
        ref = references[key(r.request)]
        assert r.complete and r.answer() == ref.answer()


# --------------------------------------------------------------- preemption ----

def test_preemption_under_load_keeps_outputs_exact(toy_servers, preempt_load, references):
    results = preempt_load["results"]
    stats = summary(results)
    assert stats["lost"] == 0 and stats["statuses"] == [200], stats
    check_served_as_asked(results)
    preemptions = (gauge(preempt_load["metrics_after"], "vllm:num_preemptions_total")
                   - gauge(preempt_load["metrics_before"], "vllm:num_preemptions_total"))
    print(f"\n[load] preemptions: {preemptions:.0f}")
    assert preemptions > 0, "the tiny KV cache did not force a preemption: the test no longer covers recompute"
    greedy = [r for r in results if r.request.greedy and not r.cancelled]
    assert len(greedy) >= len(results) // 3
    for r in greedy:
        ref = references[key(r.request)]
        assert r.answer() == ref.answer(), (r.request.kind, r.request.index, r.text(), ref.text())
    assert preempt_load["idle"] == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                                    "vllm:kv_cache_usage_perc": 0}
    check_spec_counters(preempt_load["metrics_before"], preempt_load["metrics_after"])


def test_no_traceback_in_server_logs(toy_servers, dflash_load, preempt_load):
    """Read before the servers shut down (their shutdown may log one)."""
    for name in ("dflash", "dflash_small", "plain"):
        log = toy_servers[name].log_text()
        assert "Traceback" not in log, f"{name} server log:\n" + log[log.index("Traceback") - 2000:][:6000]
        assert "EngineDeadError" not in log and "Internal Server Error" not in log, name
