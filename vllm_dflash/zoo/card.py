"""Model card (README.md) for a built toy target, from its training record.

Written by `build` and rerunnable (`vllm-dflash zoo card --out DIR`), so the numbers
in the card are always the ones the run measured; samples are greedy generations
from the saved files, one held-out prompt per category.
"""

from __future__ import annotations

import json
import os

import torch

from vllm_dflash.zoo.corpus import HELDOUT_MODULUS
from vllm_dflash.zoo import CATEGORIES, ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MASK_TOKEN, MASK_TOKEN_ID, PAD_TOKEN_ID


def greedy_samples(out: str, max_new_tokens: int = 160) -> dict[str, tuple[str, str]]:
    """category -> (held-out prompt, greedy response), generated with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = json.load(open(os.path.join(out, "eval_prompts.json")))
    samples = {}
    for cat in CATEGORIES:
        prompt = prompts[cat][0]
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples[cat] = (prompt, tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return samples


# What each corpus (zoo.corpus.CORPORA) teaches, for the card's prose.
CORPUS_CARD = {
    "stdlib": {
        "role": "the bundled target for DFlash speculative decoding (tests, demo, benchmarks)",
        "knows": "the Python standard library's source and docstrings and synthetic arithmetic word problems",
        "origin": "The corpus comes from the running Python's standard library, so another Python version "
                  "gives another corpus and tokenizer.",
        "unit": "stdlib module",
        "rows": {"code": '"Write the Python function `f` from module `m`." -> the source',
                 "math": "a word problem -> worked steps and `Answer: N`",
                 "prose": '"Explain what `m.f` does." -> the docstring'}},
    "unix": {
        "role": "a second target, of another shape and corpus, for checking the drafter training recipe",
        "knows": "the Perl modules and man pages of this machine's Linux distribution and synthetic list tasks",
        "origin": "The corpus comes from the machine's /usr/share/perl* and /usr/share/man, so another "
                  "distribution gives another corpus and tokenizer.",
        "unit": "Perl module or man page",
        "rows": {"code": '"Write the Perl subroutine `s` from module `M`." -> the source',
                 "math": "a list task (sort, sum, count, reverse) -> worked steps and `Answer: ...`",
                 "prose": '"Describe the `cmd` command." -> its NAME line and DESCRIPTION'}},
}


def _table(final: dict) -> str:
    rows = ["| split | " + " | ".join(CATEGORIES) + " |", "|---|" + "---|" * len(CATEGORIES)]
    for split in ("train", "heldout"):
        rows.append(f"| {split} | " + " | ".join(f"{final[split][c]:.3f}" for c in CATEGORIES) + " |")
    return "\n".join(rows)


def _replay_command(info: dict) -> str:
    words = (info["command"] or "vllm-dflash zoo build").split()
    kept, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--minutes", "--steps"):
            skip = True
        else:
            kept.append(w)
    return " ".join(kept + ["--steps", str(info["steps"])])


def write_card(out: str) -> str:
    info = json.load(open(os.path.join(out, "training_info.json")))
    cfg = json.load(open(os.path.join(out, "config.json")))
    c = info["config"]
    samples = greedy_samples(out)
    sample_text = "\n\n".join(
        f"**{cat}** (held-out prompt, greedy, transformers):\n\n> {p}\n\n```\n{r.strip()}\n```"
        for cat, (p, r) in samples.items())
    replay = _replay_command(info)
    corpus = CORPUS_CARD[c.get("corpus", "stdlib")]
    rows = corpus["rows"]
    text = f"""# {os.path.basename(os.path.normpath(out))}

A small Qwen3 language model trained from scratch on this machine by
`vllm-dflash zoo build`, as {corpus['role']}. It knows only {corpus['knows']};
it is not a useful assistant.

## Build

```
{info['command'] or 'vllm-dflash zoo build --out models/toy-target'}
```

With `--minutes`, the cosine learning-rate decay runs over the wall-clock time left
after warmup, so the budget is used whatever the load of the (shared) CPU; this run
reached {info['steps']:,} steps. `{replay}` replays the same data order and step
count with a step-based cosine (the same schedule up to load jitter). {corpus['origin']}

## Model

- `Qwen3ForCausalLM`, {info['parameters']:,} parameters (embeddings tied to the LM head, counted once)
- hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads,
  {cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, intermediate {cfg['intermediate_size']},
  rope_theta 10000, max_position_embeddings {cfg['max_position_embeddings']}
- weights in bf16 safetensors
- tokenizer: byte-level BPE, {cfg['vocab_size']} tokens, digits split one per token, Qwen-style
  chat template (`<|im_start|>role\\n...<|im_end|>\\n`)

| token | id |
|---|---|
| `<\\|endoftext\\|>` | {ENDOFTEXT_ID} |
| `<\\|im_start\\|>` | {IM_START_ID} |
| `<\\|im_end\\|>` (eos) | {IM_END_ID} |
| `<\\|pad\\|>` | {PAD_TOKEN_ID} |
| `{MASK_TOKEN.replace('|', chr(92) + '|')}` (**DFlash mask token**, `vllm_dflash.zoo.MASK_TOKEN_ID`) | {MASK_TOKEN_ID} |
| `<\\|reserved_1\\|>` .. `<\\|reserved_7\\|>` | {MASK_TOKEN_ID + 1} .. {MASK_TOKEN_ID + 7} |

`generation_config.json` stops on both `<|im_end|>` and `<|endoftext|>`.

## Data

Every example is one chat turn (user prompt, assistant response) followed by
`<|endoftext|>`, packed into rows of {c['seq_len']} tokens.

| category | training docs | held-out docs | prompt |
|---|---|---|---|
| code | {info['corpus_docs']['code']:,} | {info['heldout_docs']['code']:,} | {rows['code']} |
| math | {info['corpus_docs']['math']:,} | {info['heldout_docs']['math']:,} | {rows['math']} |
| prose | {info['corpus_docs']['prose']:,} | {info['heldout_docs']['prose']:,} | {rows['prose']} |

About one {corpus['unit']} in {HELDOUT_MODULUS} is held out entirely (by a hash of its name); math
holds out a separate seeded stream. `eval_prompts.json` holds {len(json.load(open(os.path.join(out, 'eval_prompts.json')))['code'])}
held-out user messages per category (apply the chat template yourself).

## Training

- {info['steps']:,} steps x {c['batch_size']} rows x {c['seq_len']} tokens = **{info['tokens_trained']:,} tokens**
  (the packed corpus holds {info['corpus_tokens']:,})
- AdamW (lr {c['lr']}, betas 0.9/0.95, weight decay {c['weight_decay']}), {c['warmup_steps']} warmup steps then cosine to
  {c['min_lr_ratio']:g} x lr, grad clip {c['grad_clip']}, {info.get('autocast', 'bf16')} autocast on CPU, {info['threads']} thread(s), seed {c['seed']}
- training loop {info['train_loop_seconds'] / 60:.1f} min ({info['total_seconds'] / 60:.1f} min in all, shared 2-core CPU),
  median step {info['median_step_seconds']:.2f} s
- loss of the first step {info['first_train_loss']:.3f}; mean of the last 50 steps {info['final_train_loss_last50']:.3f}

Final loss per category ({c['eval_rows']} rows of {c['seq_len']} tokens each; `train` = a sample of training
documents, `heldout` = held-out documents):

{_table(info['final_losses'])}

## Samples

{sample_text}
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)
    return text
