"""Byte-level BPE tokenizer for the toy target, with a Qwen-style chat template.

Digits are split one per token (as Qwen does) so arithmetic is learnable; special
tokens take the first ids in `SPECIAL_TOKENS` order (see vllm_dflash.zoo).
Saved with tokenizer_config.json so AutoTokenizer and vLLM load it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vllm_dflash.zoo import (ENDOFTEXT, IM_END, IM_START, MASK_TOKEN, MASK_TOKEN_ID, PAD, RESERVED,
                             SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(prompt: str, response: str | None = None) -> str:
    """The chat template as a plain function (training text must match it exactly)."""
    text = f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"
    if response is not None:
        text += f"{response}{IM_END}\n"
    return text


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 64:
        raise ValueError(f"vocab_size={vocab_size}: need at least {256 + len(SPECIAL_TOKENS) + 64} "
                         "(256 bytes, the special tokens and some merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(MASK_TOKEN) != MASK_TOKEN_ID:
        raise RuntimeError(f"{MASK_TOKEN} got id {tok.token_to_id(MASK_TOKEN)}, expected {MASK_TOKEN_ID}")
    return tok


def wrap(tok: Tokenizer, max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The transformers tokenizer that `save_pretrained` writes out."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None, bos_token=None,
        additional_special_tokens=[ENDOFTEXT, IM_START, *RESERVED], model_max_length=max_length,
        clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf
