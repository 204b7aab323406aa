"""Training data: prompts, and responses the target itself generates through vLLM.

DFlash learns to predict the target's own continuations, so responses come from
the target (greedy and/or sampled), not from a fixed dataset. Generation is the
slow part, so responses are cached on disk as JSONL of token ids, appended chunk
by chunk: an interrupted run resumes where it stopped and a rerun reuses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

CACHE_KIND = "vllm-dflash-responses/v1"


@dataclass
class Prompt:
    prompt_ids: list[int]
    category: str = "default"


@dataclass
class Sample:
    """One training sequence: prompt tokens followed by the target's response tokens."""

    tokens: list[int]
    prompt_len: int
    category: str = "default"

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def load_tokenizer(target: str):
    """The target's tokenizer, or None for tokenizer-less checkpoints (prompt_ids only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError, TypeError):
        return None


def encode_chat(tokenizer, text: str) -> list[int]:
    """A user turn in the target's chat template (plain text when it has none)."""
    if tokenizer is None:
        raise ValueError("prompts given as text need the target's tokenizer; this target has none, "
                         "so give prompts as {\"prompt_ids\": [...]} JSONL rows")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


def toy_prompts(split: str = "train", limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(category, text) of the toy target's own corpus, balanced over its categories.

    The train split holds the prompts the toy target was trained on: the drafter
    should see the distribution it will be asked to draft for.
    """
    from vllm_dflash.zoo.corpus import build_corpus

    per_cat = None if limit is None else -(-limit // 3)
    math_train = 40000 if per_cat is None else max(per_cat, 1)
    corpus = build_corpus(seed=0, math_train=math_train)
    rng = random.Random(seed)
    out = []
    for category, examples in sorted(corpus.by_category(split).items()):
        examples = list(examples)
        rng.shuffle(examples)
        out += [(category, ex.prompt) for ex in examples[:per_cat]]
    rng.shuffle(out)
    return out[:limit] if limit is not None else out


def _row_to_prompt(row: Any, tokenizer, where: str) -> Prompt:
    if isinstance(row, str):
        return Prompt(encode_chat(tokenizer, row))
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(row).__name__}")
    category = str(row.get("category", "default"))
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_ids must be a non-empty list of token ids")
        return Prompt(list(ids), category)
    if "messages" in row:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: 'messages' needs a target tokenizer with a chat template")
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return Prompt(list(ids), category)
    for key in ("prompt", "text", "question", "instruction"):
        if key in row:
            return Prompt(encode_chat(tokenizer, str(row[key])), category)
    raise ValueError(f"{where}: a prompt row needs one of prompt_ids, messages, prompt, text "
                     f"(got keys {sorted(row)})")


def load_prompts(source: str, tokenizer=None, limit: int | None = None, seed: int = 0,
                 split: str = "train") -> list[Prompt]:
    """Prompts from `toy` (the bundled corpus), a .jsonl/.json file, or a text file (one per line)."""
    if source == "toy":
        return [Prompt(encode_chat(tokenizer, text), cat) for cat, text in toy_prompts(split, limit, seed)]
    if not os.path.exists(source):
        raise ValueError(f"--prompts {source!r}: no such file; give a .jsonl/.json/.txt file or 'toy'")
    with open(source, encoding="utf-8") as f:
        text = f.read()
    if source.endswith(".jsonl"):
        rows = [(json.loads(line), f"{source}:{i + 1}") for i, line in enumerate(text.splitlines())
                if line.strip()]
    elif source.endswith(".json"):
        data = json.loads(text)
        if isinstance(data, dict):   # {category: [prompt, ...]}
            data = [{"category": cat, **(p if isinstance(p, dict) else {"prompt": p})}
                    for cat, ps in data.items() for p in ps]
        rows = [(row, f"{source}[{i}]") for i, row in enumerate(data)]
    else:
        rows = [(line, f"{source}:{i + 1}") for i, line in enumerate(text.splitlines()) if line.strip()]
    prompts = [_row_to_prompt(row, tokenizer, where) for row, where in rows]
    if not prompts:
        raise ValueError(f"--prompts {source!r} holds no prompts")
    if limit is not None and limit < len(prompts):
        prompts = random.Random(seed).sample(prompts, limit)
    return prompts


def per_category(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts of each category (all when limit is None), in file order."""
    if limit is None:
        return prompts
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
        if counts[p.category] <= limit:
            out.append(p)
    return out


def stop_token_ids(target: str, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's eos plus the configs' eos ids."""
    from transformers import AutoConfig, GenerationConfig

    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    sources = [AutoConfig.from_pretrained(target)]
    try:
        sources.append(GenerationConfig.from_pretrained(target))
    except OSError:
        pass
    for cfg in sources:
        eos = getattr(cfg, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


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
                       engine_kwargs: dict | None = None) -> list[Sample]:
    """Target-generated samples, one per (prompt, temperature), cached in `cache_path`.

    Prompts that leave fewer than 16 tokens for the response within `max_len`
    are skipped (recorded as empty responses so they are not retried).
    `engine_kwargs` go to `vllm.LLM` (e.g. dtype, enforce_eager).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures}: use 0 (greedy) or positive values")
    jobs = [(i, t) for t in temperatures for i in range(len(prompts))]
    digest = hashlib.sha1(json.dumps([[p.category, p.prompt_ids] for p in prompts]).encode()).hexdigest()
    header = {"kind": CACHE_KIND, "target": os.path.abspath(target), "num_prompts": len(prompts),
              "prompts": digest, "max_new_tokens": max_new_tokens, "temperatures": list(temperatures),
              "max_len": max_len, "seed": seed}
    os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
    done = _read_cache(cache_path, header) if os.path.exists(cache_path) else {}
    todo = [j for j in range(len(jobs)) if j not in done]
    if todo:
        _generate_into(target, prompts, jobs, todo, cache_path, header, done, max_new_tokens, max_len, seed,
                       chunk_size, {"gpu_memory_utilization": gpu_memory_utilization, **(engine_kwargs or {})})
    return [done[j] for j in range(len(jobs)) if done[j].response_len > 0]


def _generate_into(target, prompts, jobs, todo, cache_path, header, done, max_new_tokens, max_len, seed,
                   chunk_size, engine_kwargs) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stops = stop_token_ids(target, load_tokenizer(target))
    llm = LLM(model=target, skip_tokenizer_init=True, max_model_len=max_len, seed=seed,
              enable_prefix_caching=False, **engine_kwargs)
    fresh = not os.path.exists(cache_path) or os.path.getsize(cache_path) == 0
    with open(cache_path, "a", encoding="utf-8") as out:
        if fresh:
            out.write(json.dumps(header) + "\n")
        bar = tqdm(total=len(todo), desc="generating responses", unit="seq")
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start:start + chunk_size]
            requests, params, kept = [], [], []
            for j in chunk:
                p, temp = prompts[jobs[j][0]], jobs[j][1]
                budget = min(max_new_tokens, max_len - len(p.prompt_ids))
                if budget < 16:
                    done[j] = Sample(list(p.prompt_ids), len(p.prompt_ids), p.category)
                    continue
                requests.append(TokensPrompt(prompt_token_ids=list(p.prompt_ids)))
                params.append(SamplingParams(temperature=temp, max_tokens=budget, stop_token_ids=stops,
                                             detokenize=False, seed=seed + j if temp > 0 else None))
                kept.append(j)
            outputs = llm.generate(requests, params, use_tqdm=False) if requests else []
            for j, o in zip(kept, outputs):
                p = prompts[jobs[j][0]]
                done[j] = Sample(list(p.prompt_ids) + list(o.outputs[0].token_ids), len(p.prompt_ids),
                                 p.category)
            for j in chunk:
                out.write(json.dumps({"i": j, **asdict(done[j])}) + "\n")
            out.flush()
            bar.update(len(chunk))
        bar.close()
    del llm
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()   # free the engine before features and training start


def usable(samples: list[Sample], block_size: int, max_len: int) -> list[Sample]:
    """Samples truncated to max_len that still have room for one block in the response."""
    from vllm_dflash.training.anchors import num_valid_anchors

    out = []
    for s in samples:
        tokens = s.tokens[:max_len]
        if num_valid_anchors(s.prompt_len, len(tokens), block_size) > 0:
            out.append(Sample(tokens, s.prompt_len, s.category))
    return out
