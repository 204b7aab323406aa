"""Turn `speculative_config={"method": "dflash", ...}` into a complete one.

vLLM 0.32's `SpeculativeConfig` needs both `model` and
`num_speculative_tokens` for method "dflash" (config/speculative.py: without
`model` it never builds a draft config and `_verify_args` fails with
"num_speculative_tokens must be provided"; with `model` but no count it
fails with "A speculative model was provided, but `num_speculative_tokens`
was not provided"). Here, before vLLM sees the dict:

* a missing `model` is looked up in the table of z-lab's published drafts;
* the draft's config.json is validated against the target
  (`vllm_dflash.config.validate_draft_config`), so a bad draft fails at
  `LLM(...)` with a ValueError naming the field and the fix;
* a missing `num_speculative_tokens` becomes the draft's `block_size - 1`;
* our `draft_sample` key becomes vLLM's `draft_sample_method`.

After vLLM built the SpeculativeConfig, the validated `DFlashConfig` is
attached to it (`dflash_config_of`), so it travels with the config into the
engine and worker processes: the proposer and the draft model read
mask_token_id, target_layer_ids and block_size from it, and from nowhere
else. `complete_speculative_config` runs inside vLLM's
`EngineArgs.create_speculative_config` (a patch in vllm_dflash.patches).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from vllm_dflash import envs
from vllm_dflash.config import DFlashConfig, validate_draft_config
from vllm_dflash.serving.draft_sample import vllm_draft_sample_method

logger = logging.getLogger("vllm.vllm_dflash")

# Target (Hugging Face id) -> z-lab's published DFlash draft for it.
KNOWN_DRAFTS: dict[str, str] = {
    "Qwen/Qwen3-4B": "z-lab/Qwen3-4B-DFlash-b16",
    "Qwen/Qwen3-8B": "z-lab/Qwen3-8B-DFlash-b16",
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": "z-lab/Qwen3-Coder-30B-A3B-DFlash",
    "meta-llama/Llama-3.1-8B-Instruct": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
    "openai/gpt-oss-20b": "z-lab/gpt-oss-20b-DFlash",
}


def known_draft_for(target: str) -> str | None:
    """The published draft for `target`: a hub id, a local copy named like it
    (`/models/Qwen3-8B`) or a hub cache snapshot of it."""
    path = target.rstrip("/").lower()
    for target_id, draft in KNOWN_DRAFTS.items():
        org, name = target_id.lower().split("/")
        if path == f"{org}/{name}" or os.path.basename(path) == name:
            return draft
        if f"models--{org}--{name}/" in path + "/":
            return draft
    return None


def read_draft_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """config.json of a local draft directory or a Hugging Face repo."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"speculative_config.model={model!r} has no config.json; point it at a "
                "DFlash draft checkpoint directory (config.json + model.safetensors)"
            )
    else:
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model, "config.json", revision=revision)
        except Exception as e:  # not a repo, no network, gated, ...
            raise ValueError(
                f"speculative_config.model={model!r} is neither a local directory nor a "
                f"Hugging Face repo whose config.json could be fetched ({type(e).__name__}: "
                f"{e}); pass the path or hub id of a DFlash draft"
            ) from e
    with open(path) as f:
        return json.load(f)


# vLLM speculative options the plugin's proposer refuses (set to a truthy value), and why.
UNSUPPORTED_OPTIONS = {
    "disable_padded_drafter_batch": "it drafts from the padded batch",
    "use_local_argmax_reduction": "its drafts take the argmax of the full-vocabulary logits",
}


def refuse_unsupported_options(get: Callable[[str], Any]) -> None:
    """ValueError naming the first unsupported option set (`get(name)`: its value)."""
    for option, why in UNSUPPORTED_OPTIONS.items():
        if get(option):
            raise ValueError(
                f"speculative_config.{option} is not supported by vllm-dflash's DFlash proposer ({why}); remove it"
            )


def resolve_dflash_speculative_config(
    spec: Mapping[str, Any], target_model_config: Any
) -> tuple[dict[str, Any], DFlashConfig]:
    """Keys to add to a dflash `spec` (only those it lacks) and the parsed draft config.

    `spec` uses vLLM's field names; `target_model_config` is vLLM's
    ModelConfig of the target (`.model`, `.hf_config`).
    """
    refuse_unsupported_options(spec.get)
    added: dict[str, Any] = {}
    model = spec.get("model")
    if not model:
        target = target_model_config.model
        model = known_draft_for(target)
        if model is None:
            known = ", ".join(f"{t} -> {d}" for t, d in KNOWN_DRAFTS.items())
            raise ValueError(
                f"speculative_config has method='dflash' but no 'model', and there is no "
                f"known DFlash draft for target {target!r} (known: {known}). Pass one: "
                "speculative_config={'method': 'dflash', 'model': '<path or hub id of a "
                "DFlash draft>'}"
            )
        logger.info("DFlash draft for %s: %s (from vllm-dflash's table)", target, model)
        added["model"] = model

    draft_config = read_draft_config(model, spec.get("revision"))
    try:
        cfg = validate_draft_config(draft_config, target_model_config.hf_config)
    except ValueError as e:
        raise ValueError(f"DFlash draft {model!r}: {e}") from None

    num = spec.get("num_speculative_tokens")
    if num is None:
        added["num_speculative_tokens"] = cfg.num_speculative_tokens
    elif isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= cfg.num_speculative_tokens:
        raise ValueError(
            f"speculative_config.num_speculative_tokens={num!r} does not fit DFlash draft "
            f"{model!r}, trained on blocks of block_size={cfg.block_size}; use an integer "
            f"in [1, {cfg.num_speculative_tokens}] or omit it (default {cfg.num_speculative_tokens})"
        )
    return added, cfg


# Attribute of vLLM's SpeculativeConfig holding the validated DFlashConfig (pickled with it).
DFLASH_CONFIG_ATTRIBUTE = "vllm_dflash_config"


def dflash_config_of(speculative_config: Any) -> DFlashConfig:
    """The DFlashConfig validated when the engine config was built."""
    cfg = getattr(speculative_config, DFLASH_CONFIG_ATTRIBUTE, None)
    if not isinstance(cfg, DFlashConfig):
        raise ValueError(
            "speculative_config carries no validated DFlash config: it was not built by "
            "EngineArgs.create_speculative_config with vllm-dflash registered. Build the engine through "
            "LLM(...), `vllm serve` or EngineArgs.create_engine_config() with the plugin installed"
        )
    return cfg


def complete_speculative_config(
    engine_args: Any,
    create: Callable[[Any, Any, Any], Any],
    target_model_config: Any,
    target_parallel_config: Any,
) -> Any:
    """vLLM's `EngineArgs.create_speculative_config` (`create`) with a dflash
    dict completed and validated first, and the DFlashConfig attached after."""
    spec = {k.replace("-", "_"): v for k, v in (engine_args.speculative_config or {}).items()}
    # vLLM merges these CLI flags into the dict itself; look at them too.
    for key, flag in (
        ("method", engine_args.spec_method),
        ("model", engine_args.spec_model),
        ("num_speculative_tokens", engine_args.spec_tokens),
    ):
        if flag is not None:
            spec[key] = flag
    cfg = None
    if spec.get("method") == "dflash":
        added, cfg = resolve_dflash_speculative_config(spec, target_model_config)
        if added:
            engine_args.speculative_config = {**(engine_args.speculative_config or {}), **added}
    # SpeculativeConfig forbids unknown keys: `draft_sample` becomes vLLM's draft_sample_method.
    sample_method = vllm_draft_sample_method(spec, use_default=envs.use_plugin_impl())
    if sample_method is not None:
        kept = {k: v for k, v in (engine_args.speculative_config or {}).items()
                if k.replace("-", "_") not in ("draft_sample", "draft_sample_method")}
        engine_args.speculative_config = {**kept, "draft_sample_method": sample_method}
    # ... and `adaptive` travels in the draft's dflash_config (serving.adaptive_option).
    from vllm_dflash.serving import adaptive_option

    adaptive = adaptive_option.adaptive_choice(spec, plugin=envs.use_plugin_impl())
    given = engine_args.speculative_config
    if given is not None and adaptive_option.ADAPTIVE_KEY in spec:
        engine_args.speculative_config = adaptive_option.without_key(given)
    if adaptive:
        engine_args.async_scheduling = adaptive_option.scheduling_for_adaptive(engine_args.async_scheduling)
    if spec.get("method") == "dflash":  # this engine's metrics folder (or none), before it starts
        from vllm_dflash.adaptive import prometheus

        prometheus.start_engine(bool(adaptive))
    try:
        result = create(engine_args, target_model_config, target_parallel_config)
    finally:
        engine_args.speculative_config = given  # a second call sees the user's keys again
    if result is not None and result.draft_model_config is not None:
        hf_config = result.draft_model_config.hf_config
        if cfg is not None:
            # The runner captures the aux layers named here; a draft that relies on
            # z-lab's default rule gets them spelled out.
            dflash = getattr(hf_config, "dflash_config", None)
            if isinstance(dflash, dict) and not dflash.get("target_layer_ids"):
                dflash["target_layer_ids"] = list(cfg.target_layer_ids)
            setattr(result, DFLASH_CONFIG_ATTRIBUTE, cfg)
        if adaptive is not None:
            adaptive_option.mark(hf_config, adaptive)
    return result
