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

import pytest
from serving_pairs import (
    PER_POS,
    adaptive_per_pos_from_prometheus,
    check_spec_metrics,
    delta,
    spec_metrics_from_prometheus,
    toy_pair,
    toy_prompts,
)
from traffic import completion_prompts
from vllm_server import running

K = 4
MAX_TOKENS = 40
NUM_PROMPTS = 6
MAX_METRICS_ROUNDS = 3

pytestmark = pytest.mark.vllm


SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = toy_pair(str(root))
    spec = {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K}
    with running({
        "dflash": dict(model=target_dir, log_path=str(root / "dflash.log"), args=SERVER_ARGS, speculative_config=spec),
        "plain": dict(model=target_dir, log_path=str(root / "plain.log"), args=SERVER_ARGS),
    }) as started:
        yield started


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
    # One request at a time, in rounds of 4 until some step drafted (at most MAX_METRICS_ROUNDS):
    # the cost-driven plan may keep drafting off for a stretch after a noisy measurement (two
    # servers share two cores here), and in one clean-clone run 4 requests of 32 tokens had not
    # drafted once, while drafting here runs ~1.3-2.5x the tokens per second of not drafting.
    prompts = completion_prompts(4 * MAX_METRICS_ROUNDS)
    for round_start in range(0, len(prompts), 4):
        for prompt in prompts[round_start:round_start + 4]:
            r = client.completions.create(model="toy", prompt=prompt, temperature=0.0, max_tokens=32,
                                          extra_body={"ignore_eos": True})
            usages.append(r.usage.completion_tokens)
        text = server.metrics_text()
        m = delta(spec_metrics_from_prometheus(text), before)
        if m["vllm:spec_decode_num_drafts"] > 0:
            break
    ours = {f: [a - b for a, b in zip(v, ours_before[f])] for f, v in adaptive_per_pos_from_prometheus(text).items()}
    assert usages == [32] * len(usages)
    tau = check_spec_metrics(m, K, fixed_length=False)
    print(f"\n/metrics after {len(usages)} completions of 32 tokens: {m}, mean acceptance length {tau:.3f}; "
          f"adaptive: {ours}")
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
