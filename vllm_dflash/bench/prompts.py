"""Benchmark prompts: built-in toy sets, JSONL, plain text and ShareGPT files.

Prompts are grouped by category (acceptance differs a lot between code, math
and prose) and tokenized once in the parent process, so every mode's
subprocess feeds the engine exactly the same token ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

# Same phrasing as the bundled toy target's training prompts (vllm_dflash.zoo.corpus),
# used when the target folder has no eval_prompts.json.
BUILTIN_PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write the Python function `dedent` from module `textwrap`.",
        "Write the Python method `Counter.most_common` from module `collections`.",
        "Write the Python function `commonprefix` from module `genericpath`.",
        "Write the Python function `nlargest` from module `heapq`.",
        "Write the Python method `Fraction.limit_denominator` from module `fractions`.",
        "Write the Python function `bisect_left` from module `bisect`.",
        "Write the Python function `shuffle` from module `random`.",
        "Write the Python method `OrderedDict.move_to_end` from module `collections`.",
    ],
    "math": [
        "Mia buys 4 apples at $3 each and 6 pens at $2 each. How much does it cost in total?",
        "Leo buys 7 notebooks at $12 each and 3 erasers at $1 each. Leo pays with $100. "
        "How much change does Leo get?",
        "A train travels 45 km per hour for 6 hours. How far does it travel?",
        "Sara has 84 stickers and shares them equally among 7 friends. How many does each friend get?",
        "Compute (17 + 8) x 4 - 36.",
        "Tom reads 23 pages a day. How many pages does he read in 9 days?",
        "A box holds 12 eggs. How many boxes are needed for 150 eggs?",
        "Ana buys 5 books at $14 each and 2 bags at $9 each. How much does it cost in total?",
    ],
    "prose": [
        "Describe the Python module `json`.",
        "Explain what `os.path.join` does.",
        "Explain what the class `collections.deque` is for.",
        "Describe the Python module `itertools`.",
        "Explain what `functools.lru_cache` does.",
        "Explain what the class `threading.Lock` is for.",
        "Describe the Python module `argparse`.",
        "Explain what `shutil.copytree` does.",
    ],
}
EVAL_PROMPTS_FILE = "eval_prompts.json"
DEFAULT_CATEGORY = "default"


def _check_sets(sets: dict[str, list[str]], source: str) -> dict[str, list[str]]:
    if not isinstance(sets, dict) or not sets:
        raise ValueError(f"prompts {source!r}: expected at least one category of prompts")
    for cat, items in sets.items():
        if not isinstance(items, list) or not items or not all(isinstance(p, str) and p for p in items):
            raise ValueError(f"prompts {source!r}: category {cat!r} must be a non-empty list of "
                             "non-empty strings")
    return sets


def _first_user_turn(conv: Sequence[Any], where: str) -> str:
    for turn in conv:
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role in ("human", "user") and isinstance(text, str) and text:
            return text
    raise ValueError(f"{where}: no human/user turn with text; ShareGPT records need "
                     '"conversations": [{"from": "human", "value": "..."}]')


def _record_prompt(rec: Any, where: str) -> tuple[str, str]:
    """One JSONL / JSON record -> (category, prompt text)."""
    if isinstance(rec, str):
        return DEFAULT_CATEGORY, rec
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected an object or a string, got {type(rec).__name__}")
    cat = str(rec.get("category", DEFAULT_CATEGORY))
    for key in ("prompt", "text", "question", "instruction"):
        if isinstance(rec.get(key), str) and rec[key]:
            return cat, rec[key]
    for key in ("conversations", "messages", "turns"):
        if isinstance(rec.get(key), list):
            conv = rec[key]
            if conv and isinstance(conv[0], str):  # MT-Bench style "turns": ["...", ...]
                return cat, conv[0]
            return cat, _first_user_turn(conv, where)
    raise ValueError(f"{where}: no prompt found; give a \"prompt\" string or ShareGPT-style "
                     '"conversations" (optionally with a "category")')


def _group(pairs: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cat, text in pairs:
        out.setdefault(cat, []).append(text)
    return out


def load_prompt_sets(source: str, target: str | None = None) -> dict[str, list[str]]:
    """Prompt texts per category from `source`.

    - "toy": the target folder's eval_prompts.json ({category: [prompt, ...]})
      when present, else the built-in sets above;
    - *.jsonl: one record per line, {"prompt": ..., "category": ...} or ShareGPT-style;
    - *.txt: one prompt per non-empty line (category "default");
    - *.json: {category: [prompts]}, or a list of records as in JSONL (ShareGPT dumps).
    """
    if source == "toy":
        path = os.path.join(target, EVAL_PROMPTS_FILE) if target else None
        if path and os.path.isfile(path):
            with open(path) as f:
                return _check_sets(json.load(f), path)
        return {k: list(v) for k, v in BUILTIN_PROMPTS.items()}
    if not os.path.isfile(source):
        raise ValueError(f"--prompts {source!r}: no such file; use 'toy' or a .jsonl/.txt/.json file")
    if source.endswith(".jsonl"):
        pairs = []
        with open(source) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"--prompts {source}:{i}: invalid JSON ({e.msg})") from None
                    pairs.append(_record_prompt(rec, f"--prompts {source}:{i}"))
        return _check_sets(_group(pairs), source)
    if source.endswith(".txt"):
        with open(source) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return _check_sets({DEFAULT_CATEGORY: lines}, source)
    if source.endswith(".json"):
        with open(source) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {source}: invalid JSON ({e.msg})") from None
        if isinstance(data, dict):
            return _check_sets(data, source)
        if isinstance(data, list):
            pairs = [_record_prompt(r, f"--prompts {source}[{i}]") for i, r in enumerate(data)]
            return _check_sets(_group(pairs), source)
        raise ValueError(f"--prompts {source}: expected an object of categories or a list of records")
    raise ValueError(f"--prompts {source!r}: unknown file type; use .jsonl, .txt or .json")


def select(sets: dict[str, list[str]], categories: Sequence[str] | None,
           num_prompts: int | None) -> dict[str, list[str]]:
    """Keep the requested categories (in the given order) and the first `num_prompts` of each."""
    if categories:
        missing = [c for c in categories if c not in sets]
        if missing:
            raise ValueError(f"--categories: {missing} not in the prompt set; available: {sorted(sets)}")
        sets = {c: sets[c] for c in categories}
    if num_prompts is not None:
        if num_prompts < 1:
            raise ValueError(f"--num-prompts={num_prompts} must be >= 1")
        sets = {c: v[:num_prompts] for c, v in sets.items()}
    return sets


def byte_token_ids(text: str, vocab_size: int, reserved: int = 8) -> list[int]:
    """Token ids for a target without a tokenizer (tiny random test models): UTF-8
    bytes mapped into [reserved, vocab_size) so special ids stay unused."""
    span = vocab_size - reserved
    if span < 2:
        raise ValueError(f"vocab_size={vocab_size} is too small for byte-level fallback prompts")
    return [reserved + b % span for b in text.encode("utf-8")]


def has_tokenizer(target: str) -> bool:
    """A local folder with tokenizer files, or a hub id (assumed to ship one)."""
    if not os.path.isdir(target):
        return True
    return any(os.path.isfile(os.path.join(target, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def encode(sets: dict[str, list[str]], target: str, chat_template: bool = True) -> dict[str, list[list[int]]]:
    """Token ids per category. Uses the target's tokenizer (and chat template when it
    has one and `chat_template`); a target folder without a tokenizer gets byte ids."""
    if not has_tokenizer(target):
        with open(os.path.join(target, "config.json")) as f:
            cfg = json.load(f)
        vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
        return {c: [byte_token_ids(p, int(vocab)) for p in ps] for c, ps in sets.items()}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    use_template = chat_template and getattr(tok, "chat_template", None)
    out = {}
    for cat, ps in sets.items():
        ids = []
        for p in ps:
            if use_template:
                enc = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True)
                enc = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
            else:
                enc = tok(p)["input_ids"]
            ids.append([int(t) for t in enc])
        out[cat] = ids
    return out
