"""Small random models shared by the tests: tiny Qwen3 / Llama targets, random
DFlash drafts, and saving them to folders vLLM and the reference loader read.

Targets are float32 with a wider init than transformers' default so that
greedy argmaxes are separated by far more than float32 rounding: equality
tests between two implementations must not hinge on near-ties.
"""

from __future__ import annotations

import os

import torch

from vllm_dflash.reference import DFlashDraftModel, new_draft_config, save_draft
from vllm_dflash.reference.model import RMSNorm


def tiny_target_config(
    arch: str = "qwen3",
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.1,
):
    """A transformers config for a tiny Qwen3 or Llama target."""
    from transformers import LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )


def tiny_target(arch: str = "qwen3", seed: int = 0, **config_kwargs):
    """A random tiny HF causal LM (Qwen3ForCausalLM or LlamaForCausalLM), float32, eval mode."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    cls = {"qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}[arch]
    torch.manual_seed(seed)
    return cls(tiny_target_config(arch, **config_kwargs)).float().eval()


def random_draft(
    target,
    num_layers: int = 2,
    block_size: int = 8,
    seed: int = 1,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    num_features: int | None = None,
    initializer_range: float = 0.1,
    randomize_norms: bool = True,
) -> DFlashDraftModel:
    """A random DFlash draft for `target` (mask token: the last vocabulary id by default)."""
    config = new_draft_config(
        target.config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=target.config.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target_layer_ids,
        num_features=num_features,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config).float()
    if randomize_norms:
        # All-ones norms make every MASK slot nearly identical (they differ only by
        # RoPE), so a random draft would propose one token per block; random norm
        # gains and sharper q/k norms make the proposals vary within a block.
        with torch.no_grad():
            for name, module in draft.named_modules():
                if isinstance(module, RMSNorm):
                    module.weight.normal_(1.0, 0.3)
                    if name.endswith(("q_norm", "k_norm")):
                        module.weight.mul_(3.0)
    return draft.eval()


def correlate_pair(target, draft, dim: int = 7, scale: float = 32.0) -> None:
    """Make a random draft agree with its target sometimes (in place).

    Both final norms get a large gain on one hidden dimension, so both models'
    argmaxes lean towards the few tokens whose LM-head column `dim` is extreme:
    random drafts then get accepted now and then (acceptance lengths up to B),
    which exercises the multi-token accept / context paths.
    """
    with torch.no_grad():
        target.model.norm.weight[dim] = scale
        draft.norm.weight[dim] = scale


def save_target(target, path: str | os.PathLike) -> str:
    """Save a target in HF format (config.json + model.safetensors), no tokenizer."""
    target.save_pretrained(path)
    return str(path)


def save_pair(target, draft, root: str | os.PathLike) -> tuple[str, str]:
    """Save target and draft under `root`; returns (target_dir, draft_dir)."""
    target_dir, draft_dir = os.path.join(root, "target"), os.path.join(root, "draft")
    save_target(target, target_dir)
    save_draft(draft, draft_dir)
    return target_dir, draft_dir


def random_prompts(
    num: int, vocab_size: int, min_len: int = 4, max_len: int = 24, seed: int = 0
) -> list[list[int]]:
    """Random token-id prompts; ids avoid the last vocabulary id (the tests' mask token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab_size - 1, (n,), generator=gen).tolist() for n in lengths]
