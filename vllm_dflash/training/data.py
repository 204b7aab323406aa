"""Training data: prompts (toy corpus, prompt files, conversations) and training samples.

The responses themselves come from the target (`responses`): DFlash learns to
predict the target's own continuations, not a fixed dataset's.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

from vllm_dflash.training import conversations


@dataclass
class Prompt:
    prompt_ids: list[int]                  # the first turn's prompt (the only one without `messages`)
    category: str = "default"
    messages: list[dict] | None = None     # a conversation: its assistant turns are regenerated

    @property
    def turns(self) -> int:
        return 1 if self.messages is None else conversations.num_turns(self.messages)


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
        return conversations.template_ids(tokenizer, [{"role": "user", "content": text}])
    return tokenizer(text)["input_ids"]


def toy_corpus_of(target: str | None) -> str:
    """The zoo corpus a toy target was built on (its training_info.json), `stdlib` by default."""
    path = os.path.join(target or "", "training_info.json")
    if target and os.path.isfile(path):
        with open(path) as f:
            return json.load(f).get("config", {}).get("corpus", "stdlib")
    return "stdlib"


def toy_prompts(split: str = "train", limit: int | None = None, seed: int = 0,
                corpus: str = "stdlib") -> list[tuple[str, str]]:
    """(category, text) of a toy target's own corpus, balanced over its categories.

    The train split holds the prompts the toy target was trained on: the drafter
    should see the distribution it will be asked to draft for.
    """
    from vllm_dflash.zoo.corpus import build_corpus

    per_cat = None if limit is None else -(-limit // 3)
    math_train = 40000 if per_cat is None else max(per_cat, 1)
    corpus = build_corpus(seed=0, math_train=math_train, kind=corpus)
    rng = random.Random(seed)
    out = []
    for category, examples in sorted(corpus.by_category(split).items()):
        examples = list(examples)
        rng.shuffle(examples)
        out += [(category, ex.prompt) for ex in examples[:per_cat]]
    rng.shuffle(out)
    return out[:limit] if limit is not None else out


def text_prompt(tokenizer, text: str, category: str = "default") -> Prompt:
    """A one-turn prompt from its text (kept as a user message, so it can join a conversation)."""
    ids = encode_chat(tokenizer, text)
    chat = getattr(tokenizer, "chat_template", None)
    return Prompt(ids, category, [{"role": "user", "content": text}] if chat else None)


def chain_turns(prompts: list[Prompt], turns: int) -> list[Prompt]:
    """Groups of `turns` consecutive same-category prompts as one conversation each, so the
    later turns run on long contexts (the earlier questions and the target's answers)."""
    if turns < 1:
        raise ValueError(f"turns={turns} (--prompt-turns / --eval-turns) must be >= 1")
    if turns == 1:
        return prompts
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        if p.messages is None:
            raise ValueError("chaining prompts into conversations needs text prompts and a tokenizer with a "
                             "chat template (token-id prompts cannot be joined)")
        groups.setdefault(p.category, []).append(p)
    out = []
    for category, ps in groups.items():
        for i in range(0, len(ps) - turns + 1, turns):
            group = ps[i:i + turns]
            out.append(Prompt(group[0].prompt_ids, category, [m for p in group for m in p.messages]))
    return out


def _row_to_prompt(row: Any, tokenizer, where: str) -> Prompt:
    if isinstance(row, str):
        return text_prompt(tokenizer, row)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object or string, got {type(row).__name__}")
    category = str(row.get("category", "default"))
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_ids must be a non-empty list of token ids")
        return Prompt(list(ids), category)
    if "messages" in row or "conversations" in row:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: a conversation needs a target tokenizer with a chat template")
        messages = conversations.parse_conversation(row, where)
        first = conversations.template_ids(tokenizer, conversations.turn_messages(messages, 0, []))
        return Prompt(first, category, messages)
    for key in ("prompt", "text", "question", "instruction"):
        if key in row:
            return text_prompt(tokenizer, str(row[key]), category)
    raise ValueError(f"{where}: a prompt row needs one of prompt_ids, messages, conversations, prompt, text "
                     f"(got keys {sorted(row)})")


def load_prompts(source: str, tokenizer=None, limit: int | None = None, seed: int = 0,
                 split: str = "train", target: str | None = None) -> list[Prompt]:
    """Prompts from `toy` (the toy target's own corpus), a .jsonl/.json file (prompts, ShareGPT or
    OpenAI-messages conversations), or a text file (one prompt per line)."""
    if source == "toy":
        return [text_prompt(tokenizer, text, cat) for cat, text in toy_prompts(split, limit, seed, toy_corpus_of(target))]
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


def usable(samples: list[Sample], block_size: int, max_len: int) -> list[Sample]:
    """Samples truncated to max_len that still have room for one block in the response."""
    from vllm_dflash.training.anchors import num_valid_anchors

    out = []
    for s in samples:
        tokens = s.tokens[:max_len]
        if num_valid_anchors(s.prompt_len, len(tokens), block_size) > 0:
            out.append(Sample(tokens, s.prompt_len, s.category))
    return out
