"""DFlash draft checkpoints in z-lab's Hugging Face format.

A checkpoint folder holds `config.json` (Qwen3 keys + `architectures:
["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `dflash_config`) and
`model.safetensors` with exactly the draft's tensors (`fc`, `hidden_norm`,
`norm`, `layers.N.*`): no `embed_tokens` / `lm_head`, which are the target's.
vLLM's in-tree DFlash and z-lab's code read the same folder.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from vllm_dflash.config import DRAFT_ARCHITECTURE, default_target_layer_ids, validate_draft_config
from vllm_dflash.reference.model import DFlashDraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Keys copied from the target: the draft shares its embedding, LM head and RoPE.
_TARGET_KEYS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "intermediate_size",
    "max_position_embeddings",
    "hidden_act",
    "rope_parameters",
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_draft_config(
    target_config: Any,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    num_features: int | None = None,
    intermediate_size: int | None = None,
    **overrides: Any,
):
    """A fresh draft config (transformers Qwen3Config) for `target_config`.

    Copies hidden size, heads, head_dim, vocab, RoPE, eps and MLP width from the
    target; `target_layer_ids` default to z-lab's rule with `num_features`
    features (default: `num_layers`). `overrides` set any other config key.
    """
    from transformers import Qwen3Config

    target = (
        target_config.get_text_config()
        if hasattr(target_config, "get_text_config")
        else target_config
    )
    n_target = target.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_target, num_features or num_layers)
    kwargs = {k: getattr(target, k) for k in _TARGET_KEYS if getattr(target, k, None) is not None}
    kwargs["head_dim"] = (
        getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    )
    if intermediate_size is not None:
        kwargs["intermediate_size"] = intermediate_size
    kwargs.update(
        num_hidden_layers=num_layers,
        architectures=[DRAFT_ARCHITECTURE],
        block_size=block_size,
        num_target_layers=n_target,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        tie_word_embeddings=False,
        attention_bias=False,
    )
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    validate_draft_config(config, target)
    return config


def _config_dict(model: DFlashDraftModel, dtype: torch.dtype) -> dict:
    cfg = model.config.to_dict()
    cfg["architectures"] = [DRAFT_ARCHITECTURE]
    cfg["tie_word_embeddings"] = False
    cfg["dtype"] = cfg["torch_dtype"] = _dtype_name(dtype)  # transformers 5 / 4 readers
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])  # transformers 4 readers
    return cfg


def save_draft(
    model: DFlashDraftModel, path: str | os.PathLike, dtype: torch.dtype | None = None
) -> None:
    """Write `model` to folder `path` in z-lab format (dtype: default the model's)."""
    from safetensors.torch import save_file

    dtype = dtype or model.fc.weight.dtype
    os.makedirs(path, exist_ok=True)
    tensors = {
        name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()
    }
    save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(_config_dict(model, dtype), f, indent=2, sort_keys=True)


def load_draft_config(path: str | os.PathLike):
    """The draft's config.json as a transformers Qwen3Config."""
    from transformers import Qwen3Config

    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(
            f"draft checkpoint {path!s} has no {CONFIG_NAME}; pass a z-lab DFlash folder"
        )
    with open(config_path) as f:
        return Qwen3Config.from_dict(json.load(f))


def _read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(path, WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        raise ValueError(
            f"draft checkpoint {path!s} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}"
        )
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(os.path.join(path, shard)))
    return tensors


def load_draft(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    target_config: Any = None,
) -> DFlashDraftModel:
    """Load a z-lab DFlash folder; dtype defaults to the stored one.

    With `target_config` the draft config is validated against the target.
    Tensor names must match exactly: missing or unexpected names raise ValueError.
    """
    config = load_draft_config(path)
    if target_config is not None:
        validate_draft_config(config, target_config)
    model = DFlashDraftModel(config)
    tensors = _read_tensors(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"draft checkpoint {path!s} does not match its config: missing tensors {missing}, "
            f"unexpected tensors {unexpected}; a z-lab DFlash checkpoint holds exactly fc, "
            "hidden_norm, norm and layers.N.* (no embed_tokens / lm_head)"
        )
    wrong = [
        f"{name}: {tuple(t.shape)} != {tuple(expected[name].shape)}"
        for name, t in tensors.items()
        if t.shape != expected[name].shape
    ]
    if wrong:
        raise ValueError(
            f"draft checkpoint {path!s} has tensors of the wrong shape (file != config): {wrong}"
        )
    stored_dtype = tensors["fc.weight"].dtype
    model.load_state_dict(tensors, strict=True)
    return model.to(device=device, dtype=dtype or stored_dtype).eval()
