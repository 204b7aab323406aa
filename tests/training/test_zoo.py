"""The bundled toy target: corpus, tokenizer, a smoke build, and the committed model."""

from __future__ import annotations

import functools
import json
import os
import re

import pytest
import torch

from vllm_dflash.zoo import (CATEGORIES, ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_TOKEN, MASK_TOKEN_ID,
                             PAD_TOKEN_ID, SPECIAL_TOKENS)
from vllm_dflash.zoo import corpus as corpus_mod
from vllm_dflash.zoo import math_problems
from vllm_dflash.zoo.tokenizer import render_chat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(ROOT, "models", "toy-target")
MODULE_RE = re.compile(r"`([\w.]+)`")


@functools.lru_cache(maxsize=1)
def _stdlib_module_names() -> frozenset[str]:
    return frozenset(m for m, _ in corpus_mod.stdlib_modules())


def _module_of(prompt: str) -> str:
    """The stdlib module a code/prose prompt names (its last backquoted name that is a module)."""
    names = MODULE_RE.findall(prompt)
    if prompt.startswith("Write the Python"):
        return names[-1]
    if prompt.startswith("Describe the Python module"):
        return names[0]
    # "Explain what `module.qual` does." -- the longest prefix that is a module.
    modules = _stdlib_module_names()
    parts = names[0].split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    raise AssertionError(f"no module in {prompt!r}")


def test_corpus_categories_non_empty_and_deterministic():
    corpus_mod.stdlib_examples.cache_clear()
    a = corpus_mod.build_corpus(seed=0, math_train=200, math_heldout=32, max_modules=60)
    corpus_mod.stdlib_examples.cache_clear()
    b = corpus_mod.build_corpus(seed=0, math_train=200, math_heldout=32, max_modules=60)
    assert a.train == b.train and a.heldout == b.heldout
    for split in ("train", "heldout"):
        cats = a.by_category(split)
        assert sorted(cats) == sorted(CATEGORIES), (split, sorted(cats))
    assert len(a.by_category("train")["math"]) == 200
    # Another seed gives other math problems, the same stdlib text.
    c = corpus_mod.build_corpus(seed=1, math_train=200, math_heldout=32, max_modules=60)
    assert c.by_category("train")["code"] == a.by_category("train")["code"]
    assert c.by_category("train")["math"] != a.by_category("train")["math"]


def test_math_solutions_are_correct_and_end_with_answer_line():
    for q, a in math_problems.problems(seed=3, stream="train", count=300):
        lines = a.splitlines()
        assert lines[-1].startswith(math_problems.ANSWER_PREFIX), a
        # Every "x op y = z" step is arithmetically right.
        for lhs, op, rhs, res in re.findall(r"(-?\d+) ([-+x/]) (\d+) = (-?\d+)", a):
            lhs, rhs, res = int(lhs), int(rhs), int(res)
            want = {"+": lhs + rhs, "-": lhs - rhs, "x": lhs * rhs, "/": lhs // rhs}[op]
            assert want == res, (q, a)


def test_heldout_split_is_disjoint_from_training():
    corpus = corpus_mod.build_corpus(seed=0, math_train=500, math_heldout=40, max_modules=200)
    train_prompts = {e.prompt for e in corpus.train}
    assert not train_prompts & {e.prompt for e in corpus.heldout}
    assert all(corpus_mod.is_heldout(e.source) for e in corpus.heldout if e.category != "math")
    assert not any(corpus_mod.is_heldout(e.source) for e in corpus.train if e.category != "math")
    assert {e.source for e in corpus.heldout if e.category == "code"}, "no held-out module in the first 200"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from vllm_dflash.zoo.train_target import build, smoke_config

    out = str(tmp_path_factory.mktemp("zoo") / "smoke-target")
    return out, build(smoke_config(out))


def test_smoke_build_lowers_loss_and_reloads_with_identical_logits(smoke):
    from transformers import AutoModelForCausalLM

    out, record = smoke
    assert record["steps"] == 40
    first = record["history"][0]
    last = record["final_losses"]
    for cat in CATEGORIES:
        # Training must cut the held-out loss by at least 10% from the untrained model.
        assert last["heldout"][cat] < 0.9 * first["heldout"][cat], (cat, first, last)
    assert record["final_train_loss_last50"] < record["first_train_loss"] - 0.5
    model = record["model"].eval()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[IM_START_ID, 40, 41, 42, IM_END_ID, 100, 200, 300]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True


def test_smoke_eval_prompts_are_heldout(smoke):
    out, _ = smoke
    prompts = json.load(open(os.path.join(out, "eval_prompts.json")))
    assert sorted(prompts) == sorted(CATEGORIES)
    corpus = corpus_mod.build_corpus(seed=0, math_train=300, math_heldout=32, max_modules=40)
    train_prompts = {e.prompt for e in corpus.train}
    for cat, ps in prompts.items():
        assert ps and not set(ps) & train_prompts, cat


def test_bad_shape_raises_value_error_naming_the_field():
    from vllm_dflash.zoo.model import TargetShape
    from vllm_dflash.zoo.train_target import BuildConfig

    with pytest.raises(ValueError, match="head_dim=48"):
        BuildConfig(shape=TargetShape(head_dim=48)).validate()
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        BuildConfig(shape=TargetShape(num_hidden_layers=4)).validate()
    with pytest.raises(ValueError, match="minutes"):
        BuildConfig(minutes=0).validate()


# ---- the committed model -------------------------------------------------------------

needs_target = pytest.mark.skipif(not os.path.exists(os.path.join(TARGET, "model.safetensors")),
                                  reason="models/toy-target not built (vllm-dflash zoo build)")


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return tok, model


@needs_target
def test_committed_tokenizer_special_tokens_and_round_trip(target):
    tok, _ = target
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == MASK_TOKEN_ID
    assert (tok.eos_token_id, tok.pad_token_id) == (IM_END_ID, PAD_TOKEN_ID)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == ENDOFTEXT_ID
    text = "def f(x):\n    return x ** 2  # squares\n\nPrix: 12,50 € — naïve ✓\tend"
    assert tok.decode(tok(text)["input_ids"]) == text
    # Digits are one token each.
    assert len(tok("1234567")["input_ids"]) == 7
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == render_chat("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@needs_target
def test_committed_target_architecture():
    cfg = json.load(open(os.path.join(TARGET, "config.json")))
    info = json.load(open(os.path.join(TARGET, "training_info.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] in (64, 128) and cfg["num_hidden_layers"] >= 6
    assert cfg["vocab_size"] == 8192 and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16"
    assert 8_000_000 <= info["parameters"] <= 15_000_000
    assert info["mask_token_id"] == MASK_TOKEN_ID
    gen = json.load(open(os.path.join(TARGET, "generation_config.json")))
    assert gen["eos_token_id"] == [IM_END_ID, ENDOFTEXT_ID]


@needs_target
def test_committed_eval_prompts_are_heldout():
    prompts = json.load(open(os.path.join(TARGET, "eval_prompts.json")))
    assert sorted(prompts) == sorted(CATEGORIES)
    assert all(len(prompts[c]) >= 32 for c in CATEGORIES)
    for cat in ("code", "prose"):
        for p in prompts[cat]:
            assert corpus_mod.is_heldout(_module_of(p)), p
    info = json.load(open(os.path.join(TARGET, "training_info.json")))
    held = {q for q, _ in math_problems.problems(0, "heldout", info["config"]["math_heldout"])}
    train = {q for q, _ in math_problems.problems(0, "train", info["config"]["math_train"], exclude=held)}
    assert set(prompts["math"]) <= held and not set(prompts["math"]) & train


@needs_target
def test_committed_target_answers_heldout_math_in_worked_format(target):
    tok, model = target
    prompts = json.load(open(os.path.join(TARGET, "eval_prompts.json")))["math"][:4]
    answered = 0
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=120, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        lines = text.strip().splitlines()
        # Worked steps of the form "a op b = c", then a final "Answer: <number>" line.
        answered += bool(lines and re.fullmatch(r"Answer: -?\d+( \w+ \d+ \w+)?", lines[-1])
                         and any(re.search(r"\d+ [-+x/] \d+ = -?\d+", line) for line in lines[:-1]))
    assert answered >= 3, f"only {answered}/4 held-out math answers have the worked format"
