"""DFlash draft config: parsing, defaults and validation against the target.

A DFlash draft config is a Qwen3-style Hugging Face config (z-lab format) with
extra keys::

    architectures: ["DFlashDraftModel"]
    block_size: 16
    num_target_layers: 36
    dflash_config: {mask_token_id: 151669, target_layer_ids: [1, 9, 17, 25, 33]}

`target_layer_ids` are 0-based target decoder layers; id i means the output of
target layer i, i.e. transformers' `hidden_states[i + 1]` (the residual stream
before the final norm). vLLM captures a *set* of layers and concatenates
them in layer order, so ids must be distinct and ascending. Everything here
works on a dict or a `PretrainedConfig` and never imports vLLM, so the
serving path, the reference model and the training pipeline share one
reading of the format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DRAFT_ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    """The DFlash-specific part of a draft config, parsed once."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    num_draft_layers: int
    hidden_size: int
    vocab_size: int
    use_swa: bool = False  # dflash_config.use_swa: sliding-window draft layers (not served by the plugin)

    @property
    def num_features(self) -> int:
        """Number of target layers whose hidden states are concatenated."""
        return len(self.target_layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per block: the first block slot holds the last verified token."""
        return self.block_size - 1


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's rule: one feature -> the middle layer; otherwise evenly spaced
    from layer 1 to layer `num_target_layers - 3`.

    For small targets the rule can repeat or leave the layer range; ids are
    clamped into [0, num_target_layers) and de-duplicated, so the result may
    hold fewer than `num_features` ids (vLLM needs distinct ids).
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers={num_target_layers} must be >= 1")
    if num_features < 1:
        raise ValueError(f"num_features={num_features} must be >= 1")
    if num_features == 1:
        raw = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        span = end - start
        raw = [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]
    clamped = (min(max(i, 0), num_target_layers - 1) for i in raw)
    return sorted(set(clamped))


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _text_config(cfg: Any) -> Any:
    """Multimodal targets keep the language model's keys in a text config."""
    if isinstance(cfg, Mapping):
        return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    get_text_config = getattr(cfg, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else cfg


def _require_int(value: Any, field: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}={value!r} must be an integer; {hint}")
    return value


def parse_draft_config(draft_cfg: Any) -> DFlashConfig:
    """Read the DFlash keys of a draft config (dict or PretrainedConfig).

    Checks what can be checked without the target; use
    `validate_draft_config` to check the pair.
    """
    dflash = _get(draft_cfg, "dflash_config")
    if not isinstance(dflash, Mapping):
        raise ValueError(
            f"draft config has dflash_config={dflash!r}; a DFlash draft needs "
            "dflash_config = {'mask_token_id': <int>, 'target_layer_ids': [<int>, ...]} "
            "(z-lab format)"
        )
    mask_token_id = dflash.get("mask_token_id", _get(draft_cfg, "mask_token_id"))
    if mask_token_id is None:
        raise ValueError(
            "dflash_config.mask_token_id is missing; set it to the id of the target "
            "vocabulary's mask token (the embedding the draft was trained with)"
        )
    mask_token_id = _require_int(
        mask_token_id, "dflash_config.mask_token_id", "use a token id of the target vocabulary"
    )

    num_draft_layers = _require_int(
        _get(draft_cfg, "num_hidden_layers"), "num_hidden_layers", "set the number of draft layers"
    )
    if num_draft_layers < 1:
        raise ValueError(f"num_hidden_layers={num_draft_layers} must be >= 1")
    hidden_size = _require_int(_get(draft_cfg, "hidden_size"), "hidden_size", "copy the target's")
    vocab_size = _require_int(_get(draft_cfg, "vocab_size"), "vocab_size", "copy the target's")

    block_size = _get(draft_cfg, "block_size")
    if block_size is None:
        raise ValueError(
            "block_size is missing; set block_size to the block length the draft was "
            "trained with (e.g. 16), i.e. num_speculative_tokens + 1"
        )
    block_size = _require_int(block_size, "block_size", "e.g. 16")
    if block_size < 2:
        raise ValueError(
            f"block_size={block_size} is too small; a block holds the last verified "
            "token plus at least one draft token, use block_size >= 2"
        )

    num_target_layers = _get(draft_cfg, "num_target_layers")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise ValueError(
                "dflash_config.target_layer_ids is missing and so is num_target_layers; "
                "set dflash_config.target_layer_ids (0-based target layers) or "
                "num_target_layers to use z-lab's default rule"
            )
        layer_ids = default_target_layer_ids(int(num_target_layers), num_draft_layers)
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence) or not layer_ids:
        raise ValueError(
            f"dflash_config.target_layer_ids={layer_ids!r} must be a non-empty list of "
            "distinct 0-based target layer ids"
        )
    for i, layer_id in enumerate(layer_ids):
        _require_int(
            layer_id, f"dflash_config.target_layer_ids[{i}]", "use 0-based target layer ids"
        )
        if layer_id < 0:
            raise ValueError(
                f"dflash_config.target_layer_ids[{i}]={layer_id} is negative; "
                "use 0-based target layer ids (id i = output of target layer i)"
            )
    seen: dict[int, int] = {}
    for i, layer_id in enumerate(layer_ids):
        if layer_id in seen:
            raise ValueError(
                f"dflash_config.target_layer_ids[{i}]={layer_id} repeats "
                f"target_layer_ids[{seen[layer_id]}]; ids must be distinct (vLLM captures a "
                f"set of layers), use e.g. {sorted(set(layer_ids))} with a matching fc width"
            )
        seen[layer_id] = i
    if list(layer_ids) != sorted(layer_ids):
        raise ValueError(
            f"dflash_config.target_layer_ids={list(layer_ids)} must be ascending (vLLM "
            f"concatenates target layers in layer order); use {sorted(layer_ids)} and "
            "permute fc.weight's input blocks to match"
        )
    if num_target_layers is None:
        num_target_layers = max(layer_ids) + 1
    num_target_layers = _require_int(
        num_target_layers, "num_target_layers", "copy the target's num_hidden_layers"
    )
    return DFlashConfig(
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(int(i) for i in layer_ids),
        num_target_layers=num_target_layers,
        num_draft_layers=num_draft_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        use_swa=bool(dflash.get("use_swa", False)),
    )


def validate_draft_config(draft_cfg: Any, target_cfg: Any) -> DFlashConfig:
    """Parse the draft config and check it fits the target; ValueError says the fix."""
    cfg = parse_draft_config(draft_cfg)
    target = _text_config(target_cfg)

    archs = _get(draft_cfg, "architectures")
    if archs and DRAFT_ARCHITECTURE not in archs:
        raise ValueError(
            f"architectures={list(archs)!r} does not name a DFlash draft; "
            f"use architectures=[{DRAFT_ARCHITECTURE!r}]"
        )

    n_layers = _get(target, "num_hidden_layers")
    for i, layer_id in enumerate(cfg.target_layer_ids):
        if layer_id >= n_layers:
            raise ValueError(
                f"dflash_config.target_layer_ids[{i}]={layer_id} is out of range for a "
                f"target with {n_layers} layers; use ids in [0, {n_layers - 1}]"
            )
    declared = _get(draft_cfg, "num_target_layers")
    if declared is not None and declared != n_layers:
        raise ValueError(
            f"num_target_layers={declared} does not match the target's "
            f"num_hidden_layers={n_layers}; the draft was made for another target: "
            f"use a draft trained for this target (num_target_layers={n_layers})"
        )

    target_hidden = _get(target, "hidden_size")
    if cfg.hidden_size != target_hidden:
        raise ValueError(
            f"hidden_size={cfg.hidden_size} does not match the target's hidden_size="
            f"{target_hidden}; the draft shares the target's embedding and LM head, "
            f"so use hidden_size={target_hidden}"
        )
    target_vocab = _get(target, "vocab_size")
    if cfg.vocab_size != target_vocab:
        raise ValueError(
            f"vocab_size={cfg.vocab_size} does not match the target's vocab_size="
            f"{target_vocab}; the draft shares the target's embedding and LM head, "
            f"so use vocab_size={target_vocab}"
        )
    if not 0 <= cfg.mask_token_id < target_vocab:
        raise ValueError(
            f"dflash_config.mask_token_id={cfg.mask_token_id} is outside the target "
            f"vocabulary; use an id in [0, {target_vocab - 1}]"
        )
    return cfg
