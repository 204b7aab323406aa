"""speculative_config["adaptive"]: true (default) | false, on the config path of LLM(...) and `vllm serve`.

vLLM's SpeculativeConfig forbids unknown keys: patch 4 takes `adaptive` out,
records it in the draft's dflash_config for the workers and turns async
scheduling off for adaptive drafts. No engine is started (engines in
adaptive mode: tests/e2e).
"""

from __future__ import annotations

import json

import pytest
from serving_pairs import tiny_pair

from vllm_dflash.serving.adaptive_option import ADAPTIVE_FIELD, adaptive_enabled


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(str(tmp_path_factory.mktemp("adaptive_config")))


def engine_args(target_dir: str, spec: dict, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target_dir, skip_tokenizer_init=True, dtype="float32",
                      gpu_memory_utilization=0.5, speculative_config=dict(spec), **kwargs)


@pytest.mark.parametrize("given, expected", [(None, True), (True, True), (False, False)])
def test_choice_reaches_the_workers_config(pair, given, expected):
    target_dir, draft_dir = pair
    spec = {"method": "dflash", "model": draft_dir, **({} if given is None else {"adaptive": given})}
    config = engine_args(target_dir, spec).create_engine_config()
    assert adaptive_enabled(config.speculative_config) is expected
    assert config.speculative_config.draft_model_config.hf_config.dflash_config[ADAPTIVE_FIELD] is expected
    if expected:
        assert config.scheduler_config.async_scheduling is False


def test_a_second_config_from_the_same_args_keeps_the_choice(pair):
    target_dir, draft_dir = pair
    args = engine_args(target_dir, {"method": "dflash", "model": draft_dir, "adaptive": False})
    args.create_engine_config()
    assert args.speculative_config["adaptive"] is False  # the user's dict is left as given
    assert adaptive_enabled(args.create_engine_config().speculative_config) is False


@pytest.mark.parametrize("value", ["yes", 1, None.__class__])
def test_invalid_value_names_the_field(pair, value):
    target_dir, draft_dir = pair
    with pytest.raises(ValueError, match=r"speculative_config.adaptive=.* is not valid; use true or false"):
        engine_args(target_dir, {"method": "dflash", "model": draft_dir, "adaptive": value}).create_engine_config()


def test_other_methods_are_told_it_is_a_dflash_option(pair):
    target_dir, _ = pair
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": True}
    with pytest.raises(ValueError, match="speculative_config.adaptive is a vllm-dflash option for method='dflash'"):
        engine_args(target_dir, spec).create_engine_config()


def test_async_scheduling_is_refused_with_a_clear_error(pair):
    target_dir, draft_dir = pair
    spec = {"method": "dflash", "model": draft_dir}
    with pytest.raises(ValueError, match=r"async scheduling .* pass async_scheduling=False .*adaptive to false"):
        engine_args(target_dir, spec, async_scheduling=True).create_engine_config()
    # Static drafts keep vLLM's own async handling (on CPU vLLM turns it off itself).
    engine_args(target_dir, {**spec, "adaptive": False}, async_scheduling=True).create_engine_config()


def test_vllm_serve_cli_flag_is_accepted(pair):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    target_dir, draft_dir = pair
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model", target_dir, "--skip-tokenizer-init", "--dtype", "float32", "--gpu-memory-utilization", "0.5",
        "--speculative-config", json.dumps({"method": "dflash", "model": draft_dir, "adaptive": False}),
    ])
    assert adaptive_enabled(AsyncEngineArgs.from_cli_args(args).create_engine_config().speculative_config) is False


def test_in_tree_dflash_takes_no_adaptive(pair, monkeypatch):
    """VLLM_DFLASH_IMPL=vllm serves vLLM's fixed-length DFlash: adaptive true is an error, false is accepted."""
    target_dir, draft_dir = pair
    monkeypatch.setenv("VLLM_DFLASH_IMPL", "vllm")
    spec = {"method": "dflash", "model": draft_dir}
    config = engine_args(target_dir, spec).create_engine_config()
    assert ADAPTIVE_FIELD not in config.speculative_config.draft_model_config.hf_config.dflash_config
    engine_args(target_dir, {**spec, "adaptive": False}).create_engine_config()
    with pytest.raises(ValueError, match="adaptive=true needs vllm-dflash's DFlash proposer"):
        engine_args(target_dir, {**spec, "adaptive": True}).create_engine_config()


def test_each_adaptive_engine_gets_its_own_metrics_folder(pair):
    """The frontend sets the workers' stats folder while building each engine's config: a new
    engine never shows an earlier one's counters, and a static engine shows none."""
    import os

    from vllm_dflash import envs
    from vllm_dflash.adaptive import prometheus

    target_dir, draft_dir = pair
    spec = {"method": "dflash", "model": draft_dir}
    engine_args(target_dir, spec).create_engine_config()
    first = envs.stats_dir()
    assert first and os.path.isdir(first) and prometheus._collector.folder == first
    engine_args(target_dir, spec).create_engine_config()
    assert envs.stats_dir() not in (None, first) and prometheus._collector.folder == envs.stats_dir()
    engine_args(target_dir, {**spec, "adaptive": False}).create_engine_config()
    assert envs.stats_dir() is None and prometheus._collector.folder is None
