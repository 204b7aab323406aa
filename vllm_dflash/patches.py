"""Every vLLM internal the plugin patches, in one place.

Written against vLLM 0.32.0. `PATCHES` names each patched symbol, why, the
vLLM version it was checked against and the signature it expects;
`tests/test_patches.py` fails loudly when a symbol moves or changes shape.

| # | symbol | why | vLLM |
|---|--------|-----|------|
| 1 | `ModelRegistry["DFlashDraftModel"]` | z-lab checkpoints load as `serving.draft_model.DFlashDraftForCausalLM` | 0.32.0 |
| 2 | `v1.worker.gpu_model_runner.DFlashProposer` | the runner builds and `isinstance`-checks its drafter by this module name | 0.32.0 |
| 3 | `config.vllm.VllmConfig._get_v2_model_runner_unsupported_features` | keep dflash on the V1 runner (patch 2); CUDA defaults to Model Runner V2 | 0.32.0 |
| 4 | `engine.arg_utils.EngineArgs.create_speculative_config` | default draft / num_speculative_tokens, draft validation as ValueError; our `draft_sample` key -> vLLM's `draft_sample_method`; our `adaptive` key -> the draft's `dflash_config`, async scheduling off | 0.32.0 |
| 5 | `v1.worker.gpu_model_runner.RejectionSampler` | DFlash verifies with `verifier.sampler.DFlashRejectionSampler` (vLLM's class for other methods) | 0.32.0 |
| 6 | `sampling_params.SamplingParams._validate_spec_decode` | allow min_p with DFlash when our verifier serves (it applies min-p at draft positions) | 0.32.0 |
| 7 | `v1.worker.gpu_model_runner.build_logitsprocs` | keep vLLM's min-p processor with DFlash when our verifier serves (vLLM drops it under speculation) | 0.32.0 |

`ADAPTIVE_INTERNALS` lists what adaptive speculation reads without patching
(runner batch state, the list-drafts path, async scheduling, the metrics
registry), each with a source marker the drift test looks for.

`VLLM_DFLASH_IMPL=vllm` skips patches 1-3 (vLLM's in-tree DFlash serves, for
comparisons); patch 4 only completes and checks the config, so it stays.
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
            # ... and `adaptive` travels in the draft's dflash_config (serving.adaptive_option).
            from vllm_dflash.serving import adaptive_option

            adaptive = adaptive_option.adaptive_choice(spec, plugin=use_plugin_impl())
            given = self.speculative_config
            if given is not None and adaptive_option.ADAPTIVE_KEY in spec:
                self.speculative_config = adaptive_option.without_key(given)
            if adaptive:
                self.async_scheduling = adaptive_option.scheduling_for_adaptive(self.async_scheduling)
            if spec.get("method") == "dflash":  # this engine's metrics folder (or none), before it starts
                from vllm_dflash.adaptive import prometheus

                prometheus.start_engine(bool(adaptive))
            try:
                result = original(self, target_model_config, target_parallel_config)
            finally:
                self.speculative_config = given  # a second call sees the user's keys again
            if result is not None and result.draft_model_config is not None:
                hf_config = result.draft_model_config.hf_config
                # The runner captures the aux layers named here; a draft that
                # relies on z-lab's default rule gets them spelled out.
                dflash = getattr(hf_config, "dflash_config", None)
                if cfg is not None and isinstance(dflash, dict) and not dflash.get("target_layer_ids"):
                    dflash["target_layer_ids"] = list(cfg.target_layer_ids)
                if adaptive is not None:
                    adaptive_option.mark(hf_config, adaptive)
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
        "unknown keys) into vLLM's draft_sample_method (greedy|probabilistic); take out the "
        "adaptive key, record it in the draft's dflash_config for the workers, turn async "
        "scheduling off for it (EngineArgs.async_scheduling, read after this method) and set up "
        "the engine's adaptive-metrics folder before the engine processes start",
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

            if use_dflash_verifier(speculative_config) and not self.logit_bias:
                return  # min_p is applied at every draft position; logit_bias still unsupported
            original(self, speculative_config)

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

PATCHES: list[Patch] = SERVING_PATCHES + VERIFIER_PATCHES


# --------------------------------------------------- internals we only read ----


@dataclass(frozen=True)
class Internal:
    """A vLLM internal the plugin relies on without patching it: read privately,
    or a behaviour the plugin depends on. `marker` must appear in the source of
    `module.symbol` (tests/test_patches.py), so a vLLM upgrade that changes it
    fails loudly."""

    module: str
    symbol: str
    process: str  # where it is used: "frontend", "engine" (scheduler) or "worker" (model runner)
    why: str
    how: str
    marker: str
    removal: str
    vllm_version: str = VLLM_VERSION


ADAPTIVE_INTERNALS: list[Internal] = [
    Internal(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_draft_token_ids_cpu", "worker",
        why="adaptive speculation returns per-request draft lists of any length (0 included) from propose()",
        how="a list[list[int]] from the drafter is passed through unchanged to the scheduler "
            "(_copy_draft_token_ids_to_cpu skips the tensor copy, take_draft_token_ids returns the lists)",
        marker="if isinstance(self._draft_token_ids, list):",
        removal="a runner API for variable-length drafts (Model Runner V2's adaptive verification)"),
    Internal(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_spec_decode_draft_probs", "worker",
        why="sampled drafts shorter than the drafted block keep their draft probabilities",
        how="the runner slices the proposer's [B, q, V] probabilities to each request's scheduled length",
        marker="self._draft_probs[row_idx, :num_draft]",
        removal="as above"),
    Internal(
        "vllm.v1.worker.gpu_input_batch", "InputBatch.update_req_spec_token_ids", "worker",
        why="how many drafts of each request the target verified this step (the scheduler may trim them)",
        how="proposer reads len(runner.input_batch.spec_token_ids[row]) for rows 0..B-1, with "
            "runner.input_batch.req_ids[row] to match outcomes by request id",
        marker="cur_spec_token_ids.extend(spec_token_ids)",
        removal="verification outcomes handed to the drafter"),
    Internal(
        "vllm.v1.spec_decode.utils", "eagle_prepare_inputs_padded_kernel", "worker",
        why="accepted drafts per request = verified - num_rejected_tokens_gpu",
        how="num_rejected = drafts + 1 - valid sampled tokens (0 without drafts), passed to propose()",
        marker="num_rejected_tokens = num_draft_tokens + 1 - valid_count",
        removal="as above"),
    Internal(
        "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "worker",
        why="partial prefills draft nothing the scheduler will use: they get no budget",
        how="proposer reads runner.discard_request_mask.np[:B]",
        marker="self.discard_request_mask = self._make_buffer(",
        removal="as above"),
    Internal(
        "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._sample_from_logits", "worker",
        why="the proposer computes the draft logits once for both sampling and the confidence feature",
        how="called with the draft logits; same as _sample_draft_tokens for a shared vocabulary",
        marker="compute_probs_and_sample_next_token(",
        removal="vLLM exposing draft logits to proposers"),
    Internal(
        "vllm.distributed.parallel_state", "GroupCoordinator.broadcast_object", "worker",
        why="tensor-parallel ranks must draft the same query length (the draft forward is collective)",
        how="rank 0's planned q is broadcast over the TP group (only when its size > 1)",
        marker="def broadcast_object(",
        removal="never: ranks time their own steps"),
    Internal(
        "vllm.v1.core.sched.scheduler", "Scheduler.update_draft_token_ids", "engine",
        why="per-request draft lists of any length become each request's spec_token_ids",
        how="the runner's lists are stored as they are (structured output may trim them)",
        marker="request.spec_token_ids = self.structured_output_manager.validate_tokens(",
        removal="-"),
    Internal(
        "vllm.v1.core.sched.async_scheduler", "AsyncScheduler._update_after_schedule", "engine",
        why="async scheduling schedules fixed-length placeholder drafts before the drafter runs, so "
            "adaptive speculation turns it off (patch 4) and the proposer refuses it",
        how="-",
        marker="request.spec_token_ids = self._spec_token_placeholders",
        removal="placeholders sized per request"),
    Internal(
        "vllm.engine.arg_utils", "EngineArgs.create_engine_config", "frontend",
        why="patch 4 sets EngineArgs.async_scheduling inside create_speculative_config",
        how="it must be read (SchedulerConfig) after create_speculative_config runs",
        marker="async_scheduling=self.async_scheduling",
        removal="-"),
    Internal(
        "vllm.v1.metrics.prometheus", "get_prometheus_registry", "frontend",
        why="adaptive metrics reach /metrics through a collector in prometheus_client's REGISTRY",
        how="with one API server /metrics serves REGISTRY (LLM.get_metrics() reads it too, names "
            "starting 'vllm:'); with PROMETHEUS_MULTIPROC_DIR a multiprocess registry without them",
        marker="return REGISTRY",
        removal="-"),
]


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
