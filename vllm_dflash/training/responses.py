"""Responses the target itself generates through vLLM, cached on disk.

DFlash learns to predict the target's own continuations, so responses come from
the target (greedy and/or sampled). Generation is the slow part, so responses are
cached as JSONL of token ids, appended chunk by chunk: an interrupted run resumes
where it stopped and a rerun reuses them. Conversations (see `conversations`) are
generated turn by turn: every assistant turn is the target's answer to the
conversation so far, its own earlier answers included, and each turn is one
training sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict

from tqdm import tqdm

from vllm_dflash.training import conversations
from vllm_dflash.training.data import Prompt, Sample, load_tokenizer, stop_token_ids

CACHE_KIND = "vllm-dflash-responses/v1"


def _read_cache(path: str, header: dict) -> dict[int, Sample]:
    """Rows of a response cache; a torn last row (interrupted run) is cut off the file."""
    done: dict[int, Sample] = {}
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines == [b""]:
        return done
    try:
        found = json.loads(lines[0])
    except json.JSONDecodeError:   # torn header: start the file over
        os.truncate(path, 0)
        return done
    if found != header:
        diff = {k: (found.get(k), v) for k, v in header.items() if found.get(k) != v}
        raise ValueError(f"response cache {path} was made with other settings {diff} (cached, wanted); "
                         "use another --out directory or delete the file to regenerate")
    good = len(lines[0]) + 1
    for line in lines[1:-1]:   # the last element follows the final newline: empty, or a torn row
        row = json.loads(line)
        done[row["i"]] = Sample(row["tokens"], row["prompt_len"], row["category"])
        good += len(line) + 1
    if os.path.getsize(path) != good:
        os.truncate(path, good)
    return done


def generate_responses(target: str, prompts: list[Prompt], cache_path: str, max_new_tokens: int = 384,
                       temperatures: tuple[float, ...] = (0.0,), max_len: int = 512, seed: int = 0,
                       chunk_size: int = 256, gpu_memory_utilization: float = 0.5,
                       engine_kwargs: dict | None = None, tokenizer=None, generate=None) -> list[Sample]:
    """Target-generated samples, one per (prompt, turn, temperature), cached in `cache_path`.

    Turns whose prompt leaves fewer than 16 tokens for the response within
    `max_len` are skipped (recorded as empty responses so they are not retried),
    and so are the later turns of that conversation. `engine_kwargs` go to
    `vllm.LLM` (e.g. dtype, enforce_eager); `generate(prompt_ids, settings) ->
    responses` replaces the engine (tests). Conversations need `tokenizer`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures}: use 0 (greedy) or positive values")
    jobs = [(i, turn, t) for t in temperatures for i, p in enumerate(prompts) for turn in range(p.turns)]
    described = [[p.category, p.prompt_ids] + ([p.messages] if p.turns > 1 else []) for p in prompts]
    header = {"kind": CACHE_KIND, "target": os.path.abspath(target), "num_prompts": len(prompts),
              "prompts": hashlib.sha1(json.dumps(described).encode()).hexdigest(),
              "max_new_tokens": max_new_tokens, "temperatures": list(temperatures), "max_len": max_len,
              "seed": seed}
    os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
    done = _read_cache(cache_path, header) if os.path.exists(cache_path) else {}
    todo = [j for j in range(len(jobs)) if j not in done]
    if todo:
        engine = generate or VLLMGenerator(target, max_len, seed, {"gpu_memory_utilization": gpu_memory_utilization,
                                                                    **(engine_kwargs or {})})
        stops = stop_token_ids(target, tokenizer if tokenizer is not None else load_tokenizer(target))
        try:
            _generate_into(prompts, jobs, todo, cache_path, header, done, max_new_tokens, max_len, seed,
                           chunk_size, tokenizer, engine, stops)
        finally:
            if generate is None:
                engine.close()
    return [done[j] for j in range(len(jobs)) if done[j].response_len > 0]


def _turn_prompt(p: Prompt, turn: int, earlier: list[Sample], tokenizer) -> list[int] | None:
    """Prompt ids of a conversation's turn from the target's earlier answers (None: an earlier
    turn was skipped, so this one is too)."""
    if turn == 0:
        return list(p.prompt_ids)
    if any(s.response_len == 0 for s in earlier):
        return None
    answers = [tokenizer.decode(s.tokens[s.prompt_len:], skip_special_tokens=True) for s in earlier]
    return conversations.template_ids(tokenizer, conversations.turn_messages(p.messages, turn, answers))


def _generate_into(prompts, jobs, todo, cache_path, header, done, max_new_tokens, max_len, seed,
                   chunk_size, tokenizer, generate, stops) -> None:
    """Generate the jobs in `todo` turn by turn (turn k's prompt holds the answers to turns < k)."""
    job_index = {job: j for j, job in enumerate(jobs)}
    fresh = not os.path.exists(cache_path) or os.path.getsize(cache_path) == 0
    with open(cache_path, "a", encoding="utf-8") as out:
        if fresh:
            out.write(json.dumps(header) + "\n")
        bar = tqdm(total=len(todo), desc="generating responses", unit="seq")
        for turn in sorted({jobs[j][1] for j in todo}):
            wave = [j for j in todo if jobs[j][1] == turn]
            for start in range(0, len(wave), chunk_size):
                chunk = wave[start:start + chunk_size]
                requests, settings, kept = [], [], []
                for j in chunk:
                    i, _, temp = jobs[j]
                    p = prompts[i]
                    earlier = [done[job_index[(i, k, temp)]] for k in range(turn)]
                    ids = _turn_prompt(p, turn, earlier, tokenizer)
                    budget = 0 if ids is None else min(max_new_tokens, max_len - len(ids))
                    if budget < 16:
                        ids = ids or list(p.prompt_ids)
                        done[j] = Sample(ids, len(ids), p.category)
                        continue
                    requests.append(ids)
                    settings.append({"temperature": temp, "max_tokens": budget, "stop_token_ids": stops,
                                     "seed": seed + j if temp > 0 else None})
                    kept.append(j)
                outputs = generate(requests, settings) if requests else []
                for j, ids, response in zip(kept, requests, outputs, strict=True):
                    done[j] = Sample(ids + list(response), len(ids), prompts[jobs[j][0]].category)
                for j in chunk:
                    out.write(json.dumps({"i": j, **asdict(done[j])}) + "\n")
                out.flush()
                bar.update(len(chunk))
        bar.close()


class VLLMGenerator:
    """The target in vLLM, started on first use: `(prompt ids, settings) -> response ids`."""

    def __init__(self, target: str, max_len: int, seed: int, engine_kwargs: dict):
        self.args = dict(model=target, skip_tokenizer_init=True, max_model_len=max_len, seed=seed,
                         enable_prefix_caching=False, **engine_kwargs)
        self.llm = None

    def __call__(self, prompts: list[list[int]], settings: list[dict]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            self.llm = _start_engine(self.args)
        params = [SamplingParams(detokenize=False, **s) for s in settings]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        if self.llm is None:
            return
        self.llm = None
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()   # free the engine before features and training start


# torchrun's variables: vLLM's engine (spawned from rank 0) must build its own world of one.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _start_engine(args: dict):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        return LLM(**args)
    finally:
        os.environ.update(saved)
