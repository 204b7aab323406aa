"""speculative_config={"method": "dflash", ...}: draft lookup, defaults and
clear errors, from the resolver up to LLM(...) construction (no engine starts:
every error here is raised while the engine config is built)."""

from __future__ import annotations

import json
import os
import pickle
import sys
from types import SimpleNamespace

import pytest


from vllm_dflash.serving import draft_resolution
from vllm_dflash.serving.draft_resolution import (
    KNOWN_DRAFTS,
    known_draft_for,
    resolve_dflash_speculative_config,
)

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from helpers import random_draft, save_pair, tiny_target

    target = tiny_target(vocab_size=128)
    draft = random_draft(target, block_size=BLOCK_SIZE, target_layer_ids=[0, 2])
    target_dir, draft_dir = save_pair(target, draft, tmp_path_factory.mktemp("pair"))
    return SimpleNamespace(target=target, target_dir=target_dir, draft_dir=draft_dir)


def _target_model_config(pair, name=None):
    return SimpleNamespace(model=name or pair.target_dir, hf_config=pair.target.config)


def _broken_draft(pair, tmp_path, **changes) -> str:
    """A copy of the draft folder with config.json keys changed."""
    path = tmp_path / "broken_draft"
    path.mkdir()
    with open(os.path.join(pair.draft_dir, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(pair.draft_dir, "model.safetensors"), path / "model.safetensors")
    return str(path)


# ------------------------------------------------------------ known drafts --


def test_known_drafts_cover_the_published_targets():
    assert KNOWN_DRAFTS == {
        "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
        "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
        "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
        "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
    }


@pytest.mark.parametrize(
    "target, draft",
    [
        ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
        ("qwen/qwen3-4b", "z-lab/Qwen3-4B-DFlash-b16"),
        ("/models/Qwen3-Coder-30B-A3B-Instruct/", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
        ("/root/.cache/huggingface/hub/models--openai--gpt-oss-20b/snapshots/abc123", "z-lab/gpt-oss-20b-DFlash"),
        ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("Qwen/Qwen3-8B-Base", None),
        ("Qwen/Qwen3-14B", None),
        ("/models/my-model", None),
    ],
)
def test_known_draft_for(target, draft):
    assert known_draft_for(target) == draft


# ---------------------------------------------------------------- resolver --


def test_num_speculative_tokens_defaults_to_block_size_minus_one(pair):
    added, cfg = resolve_dflash_speculative_config(
        {"method": "dflash", "model": pair.draft_dir}, _target_model_config(pair)
    )
    assert added == {"num_speculative_tokens": BLOCK_SIZE - 1}
    assert cfg.block_size == BLOCK_SIZE and cfg.target_layer_ids == (0, 2)


def test_given_num_speculative_tokens_is_kept(pair):
    spec = {"method": "dflash", "model": pair.draft_dir, "num_speculative_tokens": 3}
    added, _ = resolve_dflash_speculative_config(spec, _target_model_config(pair))
    assert added == {}


@pytest.mark.parametrize("num", [0, BLOCK_SIZE, True, 2.0])
def test_num_speculative_tokens_out_of_range(pair, num):
    spec = {"method": "dflash", "model": pair.draft_dir, "num_speculative_tokens": num}
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={num!r} does not fit .* \[1, {BLOCK_SIZE - 1}\]"):
        resolve_dflash_speculative_config(spec, _target_model_config(pair))


@pytest.mark.parametrize("option", ["disable_padded_drafter_batch", "use_local_argmax_reduction"])
def test_unsupported_option_is_a_clear_error(pair, option):
    with pytest.raises(ValueError, match=rf"speculative_config.{option} is not supported by vllm-dflash's DFlash "
                                         r"proposer \(.*\); remove it"):
        resolve_dflash_speculative_config({"method": "dflash", "model": pair.draft_dir, option: True},
                                          _target_model_config(pair))


def test_missing_model_for_unknown_target_says_how_to_pass_one(pair):
    with pytest.raises(ValueError, match=r"no known DFlash draft for target .* Pass one: speculative_config="):
        resolve_dflash_speculative_config({"method": "dflash"}, _target_model_config(pair))


def test_missing_model_is_looked_up(pair, monkeypatch):
    monkeypatch.setitem(draft_resolution.KNOWN_DRAFTS, "tiny-org/tiny-target", pair.draft_dir)
    added, _ = resolve_dflash_speculative_config(
        {"method": "dflash"}, _target_model_config(pair, "/models/tiny-target")
    )
    assert added == {"model": pair.draft_dir, "num_speculative_tokens": BLOCK_SIZE - 1}


def test_unreadable_draft_is_a_clear_error(tmp_path, pair):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_dflash_speculative_config({"method": "dflash", "model": str(tmp_path)}, _target_model_config(pair))
    with pytest.raises(ValueError, match="neither a local directory nor a Hugging Face repo"):
        resolve_dflash_speculative_config(
            {"method": "dflash", "model": str(tmp_path / "missing")}, _target_model_config(pair)
        )


def test_draft_for_another_target_is_rejected(pair, tmp_path):
    bad = _broken_draft(pair, tmp_path, dflash_config={"mask_token_id": 127, "target_layer_ids": [0, 9]})
    with pytest.raises(ValueError, match=r"DFlash draft .*target_layer_ids\[1\]=9 is out of range"):
        resolve_dflash_speculative_config({"method": "dflash", "model": bad}, _target_model_config(pair))


# ------------------------------------------------------------ through vLLM --


@pytest.fixture(scope="module")
def plugin():
    import vllm_dflash

    vllm_dflash.register()  # no-op when vLLM already loaded the entry point
    from vllm_dflash import envs

    if not envs.use_plugin_impl():
        pytest.skip("VLLM_DFLASH_IMPL=vllm in this environment")


def _engine_args(pair, spec, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=pair.target_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        speculative_config=spec,
        **kwargs,
    )


def test_engine_config_gets_draft_defaults(pair, plugin):
    config = _engine_args(pair, {"method": "dflash", "model": pair.draft_dir}).create_engine_config()
    spec = config.speculative_config
    assert spec.method == "dflash" and spec.model == pair.draft_dir
    assert spec.num_speculative_tokens == BLOCK_SIZE - 1
    assert spec.draft_model_config.hf_config.dflash_config["target_layer_ids"] == [0, 2]
    # The validated DFlashConfig travels with the speculative config (pickled into engine and workers).
    _, expected = resolve_dflash_speculative_config({"method": "dflash", "model": pair.draft_dir},
                                                    _target_model_config(pair))
    assert draft_resolution.dflash_config_of(spec) == expected
    assert draft_resolution.dflash_config_of(pickle.loads(pickle.dumps(config)).speculative_config) == expected
    # On CUDA, Model Runner V2 would bypass the plugin's proposer: dflash stays on V1.
    assert any("vllm-dflash" in f for f in config._get_v2_model_runner_unsupported_features())


def test_dflash_config_of_a_config_built_without_the_plugin_is_a_clear_error():
    with pytest.raises(ValueError, match="carries no validated DFlash config: it was not built by "
                                         "EngineArgs.create_speculative_config with vllm-dflash registered"):
        draft_resolution.dflash_config_of(SimpleNamespace(method="dflash"))


def test_cli_flags_get_the_same_defaults(pair, plugin):
    args = _engine_args(pair, None, spec_method="dflash", spec_model=pair.draft_dir)
    assert args.create_engine_config().speculative_config.num_speculative_tokens == BLOCK_SIZE - 1


def test_bad_draft_fails_at_llm_construction(pair, plugin, tmp_path):
    from vllm import LLM

    bad = _broken_draft(pair, tmp_path, block_size=1)
    with pytest.raises(ValueError, match=r"DFlash draft .*block_size=1 is too small"):
        LLM(
            model=pair.target_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=256,
            speculative_config={"method": "dflash", "model": bad},
        )


def test_missing_model_fails_at_llm_construction(pair, plugin):
    from vllm import LLM

    with pytest.raises(ValueError, match="no known DFlash draft for target"):
        LLM(model=pair.target_dir, skip_tokenizer_init=True, speculative_config={"method": "dflash"})
