"""The bundled toy target: a small Qwen3 trained from scratch on text every machine has.

`vllm-dflash zoo build` makes it offline and reproducibly (corpus from the Python
standard library plus seeded synthetic math, a byte-level BPE tokenizer, a
Qwen3ForCausalLM). The constants below are the tokenizer's fixed special-token ids,
which the drafter and the tests rely on.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(8))

# Trained BPE assigns special tokens the first ids, in this order.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, PAD, *RESERVED)
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
PAD_TOKEN_ID = 3
# DFlash's mask token: never produced by the corpus, so the drafter owns its meaning.
MASK_TOKEN = RESERVED[0]
MASK_TOKEN_ID = 4

CATEGORIES = ("code", "math", "prose")
