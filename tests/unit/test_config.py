"""Draft config parsing, z-lab's default layer rule and validation messages."""

import copy
import re

import pytest

from vllm_dflash.config import (
    DFlashConfig,
    default_target_layer_ids,
    parse_draft_config,
    validate_draft_config,
)

TARGET = {"num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936}

DRAFT = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "vocab_size": 151936,
    "num_hidden_layers": 5,
    "block_size": 16,
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}


def draft(**changes):
    cfg = copy.deepcopy(DRAFT)
    for key, value in changes.items():
        if key.startswith("dc_"):
            cfg["dflash_config"][key.removeprefix("dc_")] = value
        else:
            cfg[key] = value
    return cfg


def test_zlab_default_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 2) == [1, 33]


@pytest.mark.parametrize("num_layers,num_features", [(4, 2), (4, 5), (2, 3), (1, 4), (3, 3)])
def test_default_rule_is_distinct_and_in_range_for_small_targets(num_layers, num_features):
    ids = default_target_layer_ids(num_layers, num_features)
    assert ids == sorted(set(ids))
    assert 1 <= len(ids) <= num_features
    assert all(0 <= i < num_layers for i in ids)


def test_default_rule_rejects_nonsense():
    with pytest.raises(ValueError, match="num_features=0"):
        default_target_layer_ids(36, 0)
    with pytest.raises(ValueError, match="num_target_layers=0"):
        default_target_layer_ids(0, 3)


def test_parse_reads_zlab_config():
    cfg = validate_draft_config(DRAFT, TARGET)
    assert cfg == DFlashConfig(
        block_size=16,
        mask_token_id=151669,
        target_layer_ids=(1, 9, 17, 25, 33),
        num_target_layers=36,
        num_draft_layers=5,
        hidden_size=4096,
        vocab_size=151936,
    )
    assert cfg.num_features == 5 and cfg.num_speculative_tokens == 15


def test_parse_accepts_pretrained_config():
    from transformers import Qwen3Config

    cfg = parse_draft_config(Qwen3Config(**{k: v for k, v in DRAFT.items() if k != "model_type"}))
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)


def test_missing_target_layer_ids_use_default_rule():
    cfg = draft()
    del cfg["dflash_config"]["target_layer_ids"]
    assert parse_draft_config(cfg).target_layer_ids == (1, 9, 17, 25, 33)


BAD_CASES = [
    # (draft changes, target changes, message fragments: field, bad value, expected value)
    ({"dflash_config": None}, {}, ["dflash_config", "mask_token_id", "target_layer_ids"]),
    (
        {"dc_target_layer_ids": [1, 9, 17, 25, 40]},
        {},
        ["dflash_config.target_layer_ids[4]=40", "36 layers", "[0, 35]"],
    ),
    (
        {"dc_target_layer_ids": [1, 9, 17, 25, 33]},
        {"num_hidden_layers": 28},
        ["target_layer_ids[4]=33", "28 layers", "[0, 27]"],
    ),
    ({"dc_target_layer_ids": [-1, 9]}, {}, ["target_layer_ids[0]=-1", "0-based"]),
    (
        {"dc_target_layer_ids": [1, 9, 9, 25, 33]},
        {},
        ["target_layer_ids[2]=9", "target_layer_ids[1]", "distinct", "[1, 9, 25, 33]"],
    ),
    ({"dc_target_layer_ids": [9, 1]}, {}, ["target_layer_ids=[9, 1]", "ascending", "[1, 9]"]),
    ({"dc_target_layer_ids": []}, {}, ["target_layer_ids=[]", "non-empty"]),
    ({"hidden_size": 2048}, {}, ["hidden_size=2048", "hidden_size=4096"]),
    ({"vocab_size": 151000}, {}, ["vocab_size=151000", "vocab_size=151936"]),
    ({"dc_mask_token_id": None}, {}, ["dflash_config.mask_token_id", "missing", "mask token"]),
    ({"dc_mask_token_id": 151936}, {}, ["mask_token_id=151936", "[0, 151935]"]),
    ({"dc_mask_token_id": -3}, {}, ["mask_token_id=-3", "[0, 151935]"]),
    ({"dc_mask_token_id": "<mask>"}, {}, ["mask_token_id='<mask>'", "integer"]),
    ({"block_size": 1}, {}, ["block_size=1", "block_size >= 2"]),
    ({"block_size": None}, {}, ["block_size", "missing", "num_speculative_tokens + 1"]),
    ({"num_target_layers": 28}, {}, ["num_target_layers=28", "num_hidden_layers=36"]),
    (
        {"architectures": ["LlamaForCausalLM"]},
        {},
        ["architectures=['LlamaForCausalLM']", "DFlashDraftModel"],
    ),
]


@pytest.mark.parametrize("draft_changes,target_changes,fragments", BAD_CASES)
def test_validation_names_field_and_fix(draft_changes, target_changes, fragments):
    target = {**TARGET, **target_changes}
    with pytest.raises(ValueError) as err:
        validate_draft_config(draft(**draft_changes), target)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_validation_reads_multimodal_text_config():
    from transformers import Qwen3Config

    class Wrapper:
        def get_text_config(self):
            return Qwen3Config(num_hidden_layers=36, hidden_size=4096, vocab_size=151936)

    assert validate_draft_config(DRAFT, Wrapper()).num_target_layers == 36
    with pytest.raises(ValueError, match=re.escape("use hidden_size=4096")):
        validate_draft_config(draft(hidden_size=64), Wrapper())
