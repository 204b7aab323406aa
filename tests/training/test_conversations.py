"""Conversation datasets: ShareGPT and OpenAI-messages rows, every assistant turn regenerated
by the target through its chat template, each turn one training sequence."""

import json
import os

import pytest
import torch

from vllm_dflash.training import conversations
from vllm_dflash.training.data import chain_turns, load_prompts, load_tokenizer
from vllm_dflash.training.responses import generate_responses

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(REPO, "models", "toy-target")
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."},
                              {"from": "human", "value": "Write a loop."},
                              {"from": "gpt", "value": "DATASET ANSWER ONE"},
                              {"from": "human", "value": "Now in reverse."},
                              {"from": "gpt", "value": "DATASET ANSWER TWO"},
                              {"from": "human", "value": "Explain it."}]}
OPENAI = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]},
                       {"role": "assistant", "content": "DATASET ANSWER"},
                       {"role": "user", "content": "And 4?"}], "category": "math"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TARGET)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(OPENAI) + "\n")
    return str(path)


def fake_target(tokenizer):
    """A stand-in for the engine: answers turn k of every conversation with 'answer k' + <|im_end|>."""
    calls = []

    def generate(prompts, settings):
        calls.append(len(prompts))
        out = []
        for ids in prompts:
            k = tokenizer.decode(ids).count("<|im_start|>assistant") - 1
            out.append(tokenizer.encode(f"answer {k}", add_special_tokens=False) + [tokenizer.eos_token_id])
        return out

    return generate, calls


def test_rows_parse_to_system_and_user_turns(prompt_file, tokenizer):
    share, chat = load_prompts(prompt_file, tokenizer)
    assert (share.turns, chat.turns, chat.category) == (3, 2, "math")
    assert chat.messages[0] == {"role": "user", "content": "Add 2 and 3."}
    first = tokenizer.decode(share.prompt_ids)
    assert first == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite a loop.<|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert conversations.turn_messages(share.messages, 2, ["A0", "A1"]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."},
        {"role": "assistant", "content": "A0"}, {"role": "user", "content": "Now in reverse."},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Explain it."}]


def test_every_assistant_turn_is_the_targets_own(prompt_file, tokenizer, tmp_path):
    prompts = load_prompts(prompt_file, tokenizer)
    generate, calls = fake_target(tokenizer)
    cache = str(tmp_path / "responses.jsonl")
    samples = generate_responses(TARGET, prompts, cache, max_new_tokens=32, max_len=512, generate=generate,
                                 tokenizer=tokenizer)
    assert calls == [2, 2, 1]                    # turn by turn: each wave needs the answers before it
    assert len(samples) == 5 and [s.category for s in samples] == ["default"] * 3 + ["math"] * 2
    last = tokenizer.decode(samples[2].tokens)
    assert "DATASET" not in last                 # the dataset's answers never reach the target
    assert last == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite a loop.<|im_end|>\n"
                    "<|im_start|>assistant\nanswer 0<|im_end|>\n<|im_start|>user\nNow in reverse.<|im_end|>\n"
                    "<|im_start|>assistant\nanswer 1<|im_end|>\n<|im_start|>user\nExplain it.<|im_end|>\n"
                    "<|im_start|>assistant\nanswer 2<|im_end|>")
    assert tokenizer.decode(samples[2].tokens[samples[2].prompt_len:]) == "answer 2<|im_end|>"
    # Rerun: the cache holds every turn, nothing is generated again.
    again = generate_responses(TARGET, prompts, cache, max_new_tokens=32, max_len=512, generate=generate,
                               tokenizer=tokenizer)
    assert calls == [2, 2, 1] and [s.tokens for s in again] == [s.tokens for s in samples]


def test_turns_past_max_len_are_dropped_with_the_rest_of_the_conversation(prompt_file, tokenizer, tmp_path):
    prompts = load_prompts(prompt_file, tokenizer)
    generate, _ = fake_target(tokenizer)
    first_len = len(prompts[0].prompt_ids)
    samples = generate_responses(TARGET, prompts, str(tmp_path / "r.jsonl"), max_new_tokens=32,
                                 max_len=first_len + 24, generate=generate, tokenizer=tokenizer)
    # Turn 0 fits (24 >= 16 tokens of room); turn 1's longer prompt leaves < 16, so turns 1 and 2 go.
    lengths = sorted(len(s.tokens) for s in samples if s.category == "default")
    assert len(lengths) == 1 and lengths[0] <= first_len + 24


def test_bad_rows_name_the_problem(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "tool", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: message 0 has role 'tool'"):
        load_prompts(str(bad), tokenizer)
    bad.write_text(json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: the conversation has no user message"):
        load_prompts(str(bad), tokenizer)
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match="message 0 needs 'role' and 'content' keys"):
        load_prompts(str(bad), tokenizer)
    with pytest.raises(ValueError, match="needs a target tokenizer with a chat template"):
        load_prompts(str(tmp_path / "bad.jsonl"), None)


def test_chained_eval_prompts_measure_tau_by_context(tokenizer):
    """--eval-turns: held-out prompts chained into conversations; every round is filed by its context."""
    from transformers import AutoModelForCausalLM

    from vllm_dflash.reference import load_draft
    from vllm_dflash.training.evaluate import measure_tau

    torch.set_num_threads(1)
    prompts = load_prompts(os.path.join(TARGET, "eval_prompts.json"), tokenizer)
    chats = chain_turns([p for p in prompts if p.category == "code"][:4], 2)
    assert len(chats) == 2 and all(c.turns == 2 and c.category == "code" for c in chats)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = load_draft(os.path.join(REPO, "models", "toy-draft"), dtype=torch.float32, target_config=target.config)
    result = measure_tau(target, draft, chats, 24, [2], tokenizer=tokenizer, progress=False, edges=(64, 128))
    by_context = result["all"]["by_context"]
    assert list(by_context) == ["0-64", "64-128", "128+"]
    assert sum(c["rounds"] for c in by_context.values()) == result["all"]["rounds"]
    assert sum(c["tokens"] for c in by_context.values()) == result["all"]["tokens"]
    assert by_context["64-128"]["rounds"] + by_context["128+"]["rounds"] > 0   # second turns run on long contexts
    assert result["code"]["prompts"] == 2
