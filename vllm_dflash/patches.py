"""Every vLLM internal the plugin patches, in one place.

Written against vLLM 0.32.0. `PATCHES` names each patched symbol, why, the
vLLM version it was checked against and the signature it expects;
`tests/test_patches.py` fails loudly when a symbol moves or changes shape.

| # | symbol | why | vLLM |
|---|--------|-----|------|
| 1 | `ModelRegistry["DFlashDraftModel"]` | z-lab checkpoints load as `serving.draft_model.DFlashDraftForCausalLM` | 0.32.0 |
| 2 | `v1.worker.gpu_model_runner.DFlashProposer` | the runner builds and `isinstance`-checks its drafter by this module name | 0.32.0 |
| 3 | `config.vllm.VllmConfig._get_v2_model_runner_unsupported_features` | keep dflash on the V1 runner (patch 2); CUDA defaults to Model Runner V2 | 0.32.0 |
| 4 | `engine.arg_utils.EngineArgs.create_speculative_config` | default draft / num_speculative_tokens, draft validation as ValueError; our `draft_sample` key -> vLLM's `draft_sample_method` | 0.32.0 |
| 5 | `v1.worker.gpu_model_runner.RejectionSampler` | DFlash verifies with `verifier.sampler.DFlashRejectionSampler` (vLLM's class for other methods) | 0.32.0 |
| 6 | `sampling_params.SamplingParams._validate_spec_decode` | allow min_p with DFlash when our verifier serves (it applies min-p at draft positions) | 0.32.0 |
| 7 | `v1.worker.gpu_model_runner.build_logitsprocs` | keep vLLM's min-p processor with DFlash when our verifier serves (vLLM drops it under speculation) | 0.32.0 |
| 8 | `v1.worker.gpu_model_runner.GPUModelRunner._sample` | snapshot the CPU generators of discarded (partial-prefill) seeded requests (patch 9) | 0.32.0 |
| 9 | `v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync` | rewind them by state: vLLM's `set_offset` kills the CPU engine ("CPU Generator does not use offset") | 0.32.0 |

`VLLM_DFLASH_IMPL=vllm` skips patches 1-3 (vLLM's in-tree DFlash serves, for
comparisons); patch 4 only completes and checks the config, so it stays.
Patches 8-9 fix a vLLM CPU bug that has nothing to do with DFlash: they apply
in every process that loads the plugin, with or without speculation.
Each entry also names the process it acts in, the upstream reference and when
to remove it (`process`, `upstream`, `removal`; filled for 8-9 so far).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

VLLM_VERSION = "0.32.0"
IMPL_ENV = "VLLM_DFLASH_IMPL"
_MARK = "__vllm_dflash_patch__"


@dataclass(frozen=True)
class Patch:
    module: str  # module holding the patched symbol
    symbol: str  # attribute path inside the module
    why: str
    signature: tuple[str, ...]  # parameter names the patch relies on
    install: Callable[[], None]
    plugin_only: bool = True  # skipped with VLLM_DFLASH_IMPL=vllm
    vllm_version: str = VLLM_VERSION
    process: str = ""  # where it acts: "engine", "worker" or "frontend"
    upstream: str = ""  # vLLM issue / PR behind it, or why there is none
    removal: str = ""  # when it can go


def _resolve(module: str, symbol: str):
    obj = importlib.import_module(module)
    for part in symbol.split("."):
        obj = getattr(obj, part)
    return obj


def _wrap_method(owner: type, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Replace owner.name by make_wrapper(original) once (marked, so re-runs skip)."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


# ---------------------------------------------------------------- serving ----


def _register_draft_model() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(
        "DFlashDraftModel", "vllm_dflash.serving.draft_model:DFlashDraftForCausalLM"
    )


def _install_proposer() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    from vllm_dflash.serving.proposer import DFlashProposer

    runner_module.DFlashProposer = DFlashProposer


def _keep_v1_runner_for_dflash() -> None:
    from vllm.config.vllm import VllmConfig

    def make(original):
        def _get_v2_model_runner_unsupported_features(self) -> list[str]:
            unsupported = original(self)
            spec = self.speculative_config
            if spec is not None and spec.method == "dflash":
                unsupported.append("vllm-dflash's DFlash proposer (it hooks the V1 runner)")
            return unsupported

        return _get_v2_model_runner_unsupported_features

    _wrap_method(VllmConfig, "_get_v2_model_runner_unsupported_features", make)


def _complete_dflash_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            cfg = None
            spec = {k.replace("-", "_"): v for k, v in (self.speculative_config or {}).items()}
            # vLLM merges these CLI flags into the dict itself; look at them too.
            for key, flag in (
                ("method", self.spec_method),
                ("model", self.spec_model),
                ("num_speculative_tokens", self.spec_tokens),
            ):
                if flag is not None:
                    spec[key] = flag
            if spec.get("method") == "dflash":
                from vllm_dflash.serving.draft_resolution import resolve_dflash_speculative_config

                added, cfg = resolve_dflash_speculative_config(spec, target_model_config)
                if added:
                    self.speculative_config = {**(self.speculative_config or {}), **added}
            # SpeculativeConfig forbids unknown keys: `draft_sample` becomes vLLM's draft_sample_method.
            from vllm_dflash.serving.draft_sample import vllm_draft_sample_method

            sample_method = vllm_draft_sample_method(spec, use_default=use_plugin_impl())
            if sample_method is not None:
                kept = {k: v for k, v in (self.speculative_config or {}).items()
                        if k.replace("-", "_") not in ("draft_sample", "draft_sample_method")}
                self.speculative_config = {**kept, "draft_sample_method": sample_method}
            result = original(self, target_model_config, target_parallel_config)
            if cfg is not None and result is not None and result.draft_model_config is not None:
                # The runner captures the aux layers named here; a draft that
                # relies on z-lab's default rule gets them spelled out.
                dflash = getattr(result.draft_model_config.hf_config, "dflash_config", None)
                if isinstance(dflash, dict) and not dflash.get("target_layer_ids"):
                    dflash["target_layer_ids"] = list(cfg.target_layer_ids)
            return result

        return create_speculative_config

    _wrap_method(EngineArgs, "create_speculative_config", make)


SERVING_PATCHES: list[Patch] = [
    Patch(
        module="vllm.model_executor.models.registry",
        symbol="ModelRegistry.register_model",
        why="serve z-lab DFlashDraftModel checkpoints with our draft model on vLLM's paged KV cache",
        signature=("model_arch", "model_cls"),
        install=_register_draft_model,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="DFlashProposer",
        why="GPUModelRunner (and CPUModelRunner) build the dflash drafter as "
        "DFlashProposer(vllm_config, device, runner) and isinstance-check it by this name",
        signature=("self", "vllm_config", "device", "runner"),
        install=_install_proposer,
    ),
    Patch(
        module="vllm.config.vllm",
        symbol="VllmConfig._get_v2_model_runner_unsupported_features",
        why="Model Runner V2 (CUDA default) has its own DFlash speculator; listing dflash "
        "as unsupported there keeps it on the V1 runner where patch 2 applies",
        signature=("self",),
        install=_keep_v1_runner_for_dflash,
    ),
    Patch(
        module="vllm.engine.arg_utils",
        symbol="EngineArgs.create_speculative_config",
        why="fill a missing draft model (known-targets table) and num_speculative_tokens "
        "(block_size - 1) and validate the draft config before SpeculativeConfig fails deep; "
        "translate vllm-dflash's draft_sample key (argmax|sample; SpeculativeConfig forbids "
        "unknown keys) into vLLM's draft_sample_method (greedy|probabilistic)",
        signature=("self", "target_model_config", "target_parallel_config"),
        install=_complete_dflash_speculative_config,
        plugin_only=False,
    ),
]

# --------------------------------------------------------------- verifier ----


def _install_verifier() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    from vllm_dflash.verifier.sampler import DFlashRejectionSampler

    runner_module.RejectionSampler = DFlashRejectionSampler


def _allow_min_p_with_dflash_verifier() -> None:
    from vllm.sampling_params import SamplingParams

    def make(original):
        def _validate_spec_decode(self, speculative_config) -> None:
            from vllm_dflash.verifier.selection import use_dflash_verifier

            if not use_dflash_verifier(speculative_config):
                return original(self, speculative_config)
            # min_p is applied at every draft position; logit_bias is not (vLLM's
            # message would name min_p too, which is supported here).
            if self.logit_bias:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    "logit_bias is not supported with DFlash speculative decoding (vllm-dflash "
                    "verifies temperature, top-k, top-p and min_p, not logit biases); drop "
                    "logit_bias or serve this model without --speculative-config",
                    parameter="logit_bias")

        return _validate_spec_decode

    _wrap_method(SamplingParams, "_validate_spec_decode", make)


def _keep_min_p_processor_with_dflash_verifier() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    original = runner_module.build_logitsprocs
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        from vllm.v1.sample.logits_processor import LogitsProcessors, MinPLogitsProcessor

        from vllm_dflash.verifier.selection import use_dflash_verifier

        procs = original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        if is_pooling_model or not use_dflash_verifier(vllm_config.speculative_config):
            return procs
        # The bonus token's Sampler applies it; DFlashRejectionSampler reads its per-request values.
        return LogitsProcessors([*procs.all, MinPLogitsProcessor(vllm_config, device, is_pin_memory)])

    setattr(build_logitsprocs, _MARK, True)
    runner_module.build_logitsprocs = build_logitsprocs


VERIFIER_PATCHES: list[Patch] = [
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="RejectionSampler",
        why="the runner builds RejectionSampler(sampler, spec_config, device) and calls its "
        "forward / static parse_output; the subclass verifies DFlash with our kernels and "
        "stays vLLM's sampler otherwise (it decides per config: VLLM_DFLASH_VERIFIER, "
        "VLLM_DFLASH_IMPL), so it is installed even with VLLM_DFLASH_IMPL=vllm",
        signature=("self", "sampler", "spec_config", "device"),
        install=_install_verifier,
        plugin_only=False,
    ),
    Patch(
        module="vllm.sampling_params",
        symbol="SamplingParams._validate_spec_decode",
        why="vLLM rejects min_p with speculative decoding because its rejection sampler skips "
        "min-p at draft positions; ours applies it, so min_p is allowed when it verifies",
        signature=("self", "speculative_config"),
        install=_allow_min_p_with_dflash_verifier,
        plugin_only=False,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="build_logitsprocs",
        why="under speculative decoding vLLM builds only the min-tokens processor, so min_p "
        "would be ignored; with our verifier the min-p processor is kept (patch 6)",
        signature=("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs"),
        install=_keep_min_p_processor_with_dflash_verifier,
        plugin_only=False,
    ),
]

# ------------------------------------------------------------- vLLM fixes ----


def _rewind_discarded_cpu_generators() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dflash.serving import seed_rewind

    _wrap_method(GPUModelRunner, "_sample", seed_rewind.wrap_sample)
    _wrap_method(GPUModelRunner, "_bookkeeping_sync", seed_rewind.wrap_bookkeeping_sync)


_SEED_REWIND_UPSTREAM = (
    "vllm-project/vllm#10097 introduced the offset rewind ('relies on cuda-specific torch-internal impl "
    "details'); no vLLM issue for the CPU runner as of 0.32.0; same crash fixed downstream in "
    "RBLN-SW/vllm-rbln#1025"
)
_SEED_REWIND_REMOVAL = (
    "when GPUModelRunner._bookkeeping_sync no longer calls set_offset on CPU generators "
    "(tests/serving/test_seeded_chunked_prefill.py::test_vllm_still_rewinds_by_offset fails then)"
)

VLLM_FIX_PATCHES: list[Patch] = [
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="GPUModelRunner._sample",
        why="snapshot (get_state) the CPU generators of this step's discarded requests (partial "
        "prefills) before the sampler, verifier and drafter draw from them, for the state rewind "
        "of the next patch (vllm_dflash.serving.seed_rewind)",
        signature=("self", "logits", "spec_decode_metadata"),
        install=_rewind_discarded_cpu_generators,
        plugin_only=False,
        process="worker",
        upstream=_SEED_REWIND_UPSTREAM,
        removal=_SEED_REWIND_REMOVAL,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="GPUModelRunner._bookkeeping_sync",
        why="vLLM rewinds a discarded seeded sample with Generator.set_offset, which a CPU generator "
        "(mt19937) does not have: a seeded request with a chunked prefill kills the CPU engine "
        "('CPU Generator does not use offset'); restore the snapshot instead and hide those "
        "generators from vLLM's loop (other devices keep vLLM's rewind)",
        signature=("self", "scheduler_output", "sampler_output", "logits", "hidden_states", "num_scheduled_tokens"),
        install=_rewind_discarded_cpu_generators,
        plugin_only=False,
        process="worker",
        upstream=_SEED_REWIND_UPSTREAM,
        removal=_SEED_REWIND_REMOVAL,
    ),
]

PATCHES: list[Patch] = SERVING_PATCHES + VERIFIER_PATCHES + VLLM_FIX_PATCHES


def use_plugin_impl() -> bool:
    """False when VLLM_DFLASH_IMPL=vllm asks for vLLM's in-tree DFlash."""
    impl = os.environ.get(IMPL_ENV, "plugin").strip().lower()
    if impl not in ("plugin", "vllm"):
        raise ValueError(f"{IMPL_ENV}={impl!r} is not valid; use 'plugin' (default) or 'vllm'")
    return impl == "plugin"


_applied: list[Patch] = []


def applied() -> list[Patch]:
    """Patches installed in this process."""
    return list(_applied)


def apply_all() -> None:
    """Apply every patch; safe to call more than once per process."""
    plugin = use_plugin_impl()
    for patch in PATCHES:
        if patch in _applied or (patch.plugin_only and not plugin):
            continue
        patch.install()
        _applied.append(patch)
