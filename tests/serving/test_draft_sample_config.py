"""speculative_config["draft_sample"]: "argmax" | "sample" for vllm-dflash's DFlash.

vLLM's SpeculativeConfig forbids unknown keys; the create_speculative_config patch (vllm_dflash.patches)
turns ours into vLLM's draft_sample_method before SpeculativeConfig is built.
Checked on the config path `LLM(...)` and `vllm serve` share
(EngineArgs.create_engine_config, and the CLI parser for --speculative-config);
no engine is started. That sampled drafts reach the verifier with their
probabilities is checked end to end in test_sampling_e2e.py.
"""

from __future__ import annotations

import json

import pytest
from serving_pairs import tiny_pair

from vllm_dflash.serving import draft_sample
from vllm_dflash.serving.draft_sample import DEFAULT_DRAFT_SAMPLE, vllm_draft_sample_method


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(str(tmp_path_factory.mktemp("draft_sample")))


def engine_config(target_dir: str, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=target_dir, skip_tokenizer_init=True, dtype="float32",
                      gpu_memory_utilization=0.5, speculative_config=dict(spec))
    return args.create_engine_config()


# ------------------------------------------------------------- the mapping ----


@pytest.mark.parametrize("choice, method", [("argmax", "greedy"), ("sample", "probabilistic")])
def test_choice_maps_to_vllm_draft_sample_method(choice, method):
    assert vllm_draft_sample_method({"method": "dflash", "draft_sample": choice}) == method
    # Saying the same thing in vLLM's words too is fine.
    spec = {"method": "dflash", "draft_sample": choice, "draft_sample_method": method}
    assert vllm_draft_sample_method(spec) == method


def test_default_is_one_constant():
    assert DEFAULT_DRAFT_SAMPLE in draft_sample.DRAFT_SAMPLE_CHOICES
    expected = draft_sample.TO_VLLM_DRAFT_SAMPLE_METHOD[DEFAULT_DRAFT_SAMPLE]
    assert vllm_draft_sample_method({"method": "dflash"}) == expected
    # vLLM's own key wins over our default; without a default nothing is set.
    assert vllm_draft_sample_method({"method": "dflash", "draft_sample_method": "probabilistic"}) is None
    assert vllm_draft_sample_method({"method": "dflash"}, use_default=False) is None
    assert vllm_draft_sample_method({"method": "eagle3"}) is None


@pytest.mark.parametrize("value", ["topk", "greedy", "probabilistic", "", 1])
def test_invalid_value_names_the_field_and_the_choices(value):
    with pytest.raises(ValueError) as e:
        vllm_draft_sample_method({"method": "dflash", "draft_sample": value})
    message = str(e.value)
    assert "speculative_config.draft_sample=" in message and "'argmax'" in message and "'sample'" in message


def test_contradicting_vllm_key_is_rejected():
    with pytest.raises(ValueError, match=r"draft_sample='sample' contradicts draft_sample_method='greedy'"):
        vllm_draft_sample_method({"method": "dflash", "draft_sample": "sample", "draft_sample_method": "greedy"})


def test_other_methods_are_told_to_use_vllms_key():
    with pytest.raises(ValueError, match=r"draft_sample is a vllm-dflash option for method='dflash'.*draft_sample_method"):
        vllm_draft_sample_method({"method": "eagle3", "draft_sample": "sample"})


# --------------------------------------------------------- vLLM's config path ----


@pytest.mark.parametrize(
    "extra, method",
    [
        ({"draft_sample": "sample"}, "probabilistic"),
        ({"draft_sample": "argmax"}, "greedy"),
        ({"draft-sample": "sample"}, "probabilistic"),  # CLI spelling
        ({"draft_sample_method": "probabilistic"}, "probabilistic"),  # vLLM's key still works
        ({}, draft_sample.TO_VLLM_DRAFT_SAMPLE_METHOD[DEFAULT_DRAFT_SAMPLE]),
    ],
)
def test_engine_config_carries_the_choice(pair, extra, method):
    target_dir, draft_dir = pair
    config = engine_config(target_dir, {"method": "dflash", "model": draft_dir, **extra})
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.draft_sample_method == method


def test_engine_config_rejects_a_bad_value_before_vllm_does(pair):
    target_dir, draft_dir = pair
    with pytest.raises(ValueError, match=r"speculative_config.draft_sample='topk' is not valid; use one of 'argmax' or 'sample'"):
        engine_config(target_dir, {"method": "dflash", "model": draft_dir, "draft_sample": "topk"})


def test_vllm_serve_cli_flag_is_accepted(pair):
    """The JSON given to `vllm serve --speculative-config` reaches the config."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    target_dir, draft_dir = pair
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    spec = json.dumps({"method": "dflash", "model": draft_dir, "draft_sample": "sample"})
    args = parser.parse_args([
        "--model", target_dir, "--skip-tokenizer-init", "--dtype", "float32",
        "--gpu-memory-utilization", "0.5", "--speculative-config", spec,
    ])
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.draft_sample_method == "probabilistic"


def test_in_tree_dflash_keeps_vllms_default(pair, monkeypatch):
    """With VLLM_DFLASH_IMPL=vllm (vLLM's own DFlash, for comparisons) our
    default does not apply, an explicit draft_sample still does. The default is
    set to "sample" here so that it differs from vLLM's ("greedy")."""
    monkeypatch.setattr(draft_sample, "DEFAULT_DRAFT_SAMPLE", "sample")
    target_dir, draft_dir = pair
    spec = {"method": "dflash", "model": draft_dir}
    assert engine_config(target_dir, spec).speculative_config.draft_sample_method == "probabilistic"
    monkeypatch.setenv("VLLM_DFLASH_IMPL", "vllm")
    assert engine_config(target_dir, spec).speculative_config.draft_sample_method == "greedy"
    explicit = engine_config(target_dir, {**spec, "draft_sample": "sample"})
    assert explicit.speculative_config.draft_sample_method == "probabilistic"
