"""vLLM internals of the serving path: the draft model, the proposer and the
speculative config (patches and everything the proposer and draft model
override, call, read or mirror)."""

from __future__ import annotations

import dataclasses

from vllm_dflash.patches.internal import MARK, VllmInternal, wrap_once

# The runner's drafter protocol, as vLLM's generic proposer implements it (named, never imported by the
# plugin: its module imports the in-tree DFlash model; serving.drafter_base implements it for ours).
BASE_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
NEVER = "never: it is what makes the plugin's DFlash serve (vLLM's in-tree DFlash is the rival)"


def _register_draft_model() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model("DFlashDraftModel", "vllm_dflash.serving.draft_model:DFlashDraftForCausalLM")


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

    wrap_once(VllmConfig, "_get_v2_model_runner_unsupported_features", make)


def _complete_dflash_speculative_config() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            from vllm_dflash.serving.draft_resolution import complete_speculative_config

            return complete_speculative_config(self, original, target_model_config, target_parallel_config)

        return create_speculative_config

    wrap_once(EngineArgs, "create_speculative_config", make)


def _skip_glue_for_steps_without_drafts() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                    common_attn_metadata, slot_mappings):
            unverified = getattr(self.drafter, "propose_unverified_step", None)  # ours only
            if unverified is not None:
                drafts = unverified(self, scheduler_output.total_num_scheduled_tokens, aux_hidden_states,
                                    spec_decode_metadata, common_attn_metadata, sampling_metadata)
                if drafts is not None:
                    self._draft_probs = None
                    self._draft_prob_req_ids = None
                    return drafts
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                            slot_mappings)

        return propose_draft_token_ids

    wrap_once(GPUModelRunner, "propose_draft_token_ids", make)


def _no_scheduler_update_for_steps_without_drafts() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def take_draft_token_ids(self):
            drafts = self._draft_token_ids
            if drafts is not None and drafts is getattr(getattr(self, "drafter", None), "handed_no_drafts", None):
                return None
            return original(self)

        return take_draft_token_ids

    wrap_once(GPUModelRunner, "take_draft_token_ids", make)


def _without_speculative_config_on_plain_steps(name: str) -> None:
    """Wrap runner method `name` to run with runner.speculative_config None on a step that
    schedules no drafts, when the drafter is ours with plain_steps_without_drafts."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        def plain_when_nothing_is_verified(self, scheduler_output, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            # (read by the GEMM-grid padding, `_pad_target_rows_to_the_gemm_grid`)
            self._dflash_verifies_drafts = bool(scheduler_output.scheduled_spec_decode_tokens)
            if scheduler_output.scheduled_spec_decode_tokens or not getattr(drafter, "plain_steps_without_drafts",
                                                                            False):
                return original(self, scheduler_output, *args, **kwargs)
            speculative_config, self.speculative_config = self.speculative_config, None
            try:
                return original(self, scheduler_output, *args, **kwargs)
            finally:
                self.speculative_config = speculative_config

        return plain_when_nothing_is_verified

    wrap_once(GPUModelRunner, name, make)


def _plain_inputs_for_steps_without_drafts() -> None:
    _without_speculative_config_on_plain_steps("_prepare_inputs")


def _no_placeholder_clamp_for_steps_without_drafts() -> None:
    _without_speculative_config_on_plain_steps("_preprocess")


def _pad_target_rows_to_the_gemm_grid() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original):
        from vllm_dflash.serving.gemm_rows import padded_rows

        def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *args, **kwargs):
            result = original(self, num_tokens, num_reqs, *args, **kwargs)
            limit = getattr(getattr(self, "drafter", None), "gemm_row_limit", None)
            mode, descriptor, should_ubatch, across_dp, stats = result
            if limit is None or num_tokens == num_reqs or across_dp is not None or descriptor.num_tokens != num_tokens:
                return result  # plain decode, or padded already (CUDA graphs, data parallel)
            if not getattr(self, "_dflash_verifies_drafts", True):
                # A step that verifies nothing (prompt chunks beside decodes) runs as vLLM runs it without
                # speculation: its row count is the prompts', as there, and padding it to the grid had made
                # the target pass of such steps up to 1/8 longer than no speculation's (grid on vs off, adaptive steps
                # without drafting, in-flight requests: model forward +2-5% a step, float32, Zen 4 EPYC).
                return result
            padded = padded_rows(num_tokens, min(limit, self.max_num_tokens))
            if padded == num_tokens:
                return result
            return mode, dataclasses.replace(descriptor, num_tokens=padded), should_ubatch, across_dp, stats

        return _determine_batch_execution_and_padding

    wrap_once(GPUModelRunner, "_determine_batch_execution_and_padding", make)


def _no_query_block_slots_in_the_token_budget() -> None:
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.__dict__["max_num_new_slots_for_drafting"]
    if getattr(original.fget, MARK, False):
        return

    def max_num_new_slots_for_drafting(self) -> int:
        # Our query block lives in the proposer's own tensors, not in the step's token buffers: the
        # scheduler need not hold K input slots per request for it (see the register entry).
        return 0 if self.method == "dflash" else original.fget(self)

    setattr(max_num_new_slots_for_drafting, MARK, True)
    SpeculativeConfig.max_num_new_slots_for_drafting = property(max_num_new_slots_for_drafting,
                                                                 doc=original.__doc__)


ENTRIES: list[VllmInternal] = [
    # ------------------------------------------------------------ patches --
    VllmInternal(
        symbol="vllm.model_executor.models.registry:ModelRegistry.register_model",
        kind="patch",
        process=("frontend", "worker"),
        why="z-lab checkpoints say architectures=['DFlashDraftModel']; that name must load our draft model "
        "(on vLLM's paged KV cache), not vLLM's in-tree one",
        how="register_model('DFlashDraftModel', 'vllm_dflash.serving.draft_model:DFlashDraftForCausalLM'), "
        "overriding the in-tree mapping (vLLM logs a warning)",
        remove_when=NEVER,
        params=("model_arch", "model_cls"),
        ours="vllm_dflash.serving.draft_model:DFlashDraftForCausalLM",
        install=_register_draft_model,
    ),
    VllmInternal(
        symbol="vllm.v1.worker.gpu_model_runner:DFlashProposer",
        kind="patch",
        process=("worker",),
        why="GPUModelRunner (and CPUModelRunner, its subclass) builds the dflash drafter as "
        "DFlashProposer(vllm_config, device, runner) and isinstance-checks it by this module-level name",
        how="rebind the runner module's name to vllm_dflash.serving.proposer.DFlashProposer",
        remove_when="vLLM accepts an out-of-tree proposer class for a spec method (its custom_class proposer "
        "gets neither target hidden states nor a draft KV cache in 0.32)",
        params=("self", "vllm_config", "device", "runner"),
        original="vllm.v1.spec_decode.dflash:DFlashProposer",
        ours="vllm_dflash.serving.proposer:DFlashProposer",
        used_by=RUNNER,
        usage=("self.drafter = DFlashProposer(self.vllm_config, self.device, self)",
               "self.drafter.propose(", "self.drafter.dummy_run("),
        install=_install_proposer,
    ),
    VllmInternal(
        symbol=f"{RUNNER}.propose_draft_token_ids",
        kind="patch",
        process=("worker",),
        why="an adaptive step that verified no draft and plans none must cost what a step without speculation "
        "costs; vLLM's drafting glue (next-token bookkeeping, hidden states concatenated for the drafter) ran "
        "before our proposer could decide (measured on CPU: about half of what such a step added)",
        how="wrap: first DFlashProposer.propose_unverified_step(runner, total scheduled tokens, aux hidden "
        "states, spec metadata, common attention metadata, sampling metadata); its draft lists are the result "
        "(with _draft_probs cleared, as vLLM's method does), or None runs vLLM's method; other drafters: "
        "vLLM's method",
        remove_when="vLLM lets a drafter decide before its glue runs (Model Runner V2's adaptive verification)",
        params=("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                "slot_mappings"),
        ours="vllm_dflash.serving.proposer:DFlashProposer.propose_unverified_step",
        used_by=f"{RUNNER}.sample_tokens",
        usage=("self._draft_token_ids = self.propose_draft_token_ids(",),
        install=_skip_glue_for_steps_without_drafts,
    ),
    VllmInternal(
        symbol=f"{RUNNER}._determine_batch_execution_and_padding",
        kind="patch",
        process=("worker",),
        why="vLLM's CPU GEMMs make a kernel per row count on first use (0.4-0.57 ms per weight shape, AVX-512 "
        "EPYC); per-request draft lengths give target passes a new row count nearly every verify step (about "
        "15 ms on the bundled target). serving.gemm_rows pads them to a grid whose kernels are made at load",
        how="wrap: where the drafter has a gemm_row_limit (ours, on CPU) and vLLM did not pad (no CUDA graph, "
        "no data parallel), a step that verifies drafts (runner._dflash_verifies_drafts, set by the "
        "_prepare_inputs wrap) and is not plain decode (tokens != requests) gets "
        "BatchDescriptor.num_tokens = gemm_rows.padded_rows(tokens, limit); vLLM then pads input ids and "
        "positions, gives the padded rows slot -1 (CPU attention updates the cache separately) and computes "
        "attention for the real rows only (num_actual_tokens), as for CUDA-graph padding",
        remove_when="vLLM pads CPU batches to bucketed sizes itself",
        params=("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
                "use_cascade_attn", "allow_microbatching", "force_eager", "force_uniform_decode", "force_has_lora",
                "force_num_active_loras", "num_encoder_reqs"),
        used_by=f"{RUNNER}.execute_model",
        usage=("num_tokens_padded = batch_desc.num_tokens",
               "slot_mappings_by_group, slot_mappings = self._get_slot_mappings(",
               "if pad_attn or has_separate_kv_update"),
        install=_pad_target_rows_to_the_gemm_grid,
    ),
    VllmInternal(
        symbol="vllm.config.speculative:SpeculativeConfig.max_num_new_slots_for_drafting",
        kind="patch",
        process=("frontend", "engine"),
        why="vLLM's scheduler keeps this many input slots per scheduled request out of the step's token "
        "budget (`input_budget -= num_new_tokens + draft_slots`): K for DFlash, whose in-tree proposer runs its "
        "query block in the step's token buffers. Ours builds the query block in its own tensors, so the "
        "reservation only starved prompts: at 32 requests, k = 15 and 512 batched tokens, decodes alone took the "
        "whole budget, prompts were admitted 16 tokens a step, the batch ran at 28-31 requests and the same "
        "work took 330 steps against 304 without speculation (8.5% more), drafting or not",
        how="property: 0 where method == 'dflash' (vllm-dflash serves it), vLLM's value otherwise; with "
        "VLLM_DFLASH_IMPL=vllm (plugin_only) the in-tree proposer keeps its K slots",
        remove_when="vLLM asks the proposer how many slots its drafting needs",
        used_by="vllm.v1.core.sched.scheduler:Scheduler.schedule",
        usage=("draft_slots = spec.max_num_new_slots_for_drafting if spec is not None else 0",
               "input_budget -= num_new_tokens + draft_slots"),
        install=_no_query_block_slots_in_the_token_budget,
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        kind="mirror",
        process=("worker",),
        why="serving.gemm_rows finds the linears whose kernels are made per row count by what this leaves "
        "behind: a cpu_linear(x, weight, bias) callable, and an empty weight where oneDNN / zentorch / sgl "
        "packed it (torch's linear, the fallback, keeps it)",
        how="modules with a callable cpu_linear and weight.numel() == 0; cpu_linear(x, None, bias) at load",
        remove_when="with the _determine_batch_execution_and_padding patch",
        source_has=("layer.cpu_linear = lambda x, weight, bias: ops.onednn_mm(handler, x, bias)",
                    "layer.weight = torch.nn.Parameter(", "torch.empty(0, dtype=dtype, device=layer.weight.device)"),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
        kind="read",
        process=("worker",),
        why="with the cache update outside forward, vLLM pads the slot mapping of padded rows with -1 "
        "(has_separate_kv_update): padded target passes write nothing for their padding",
        how="forward_includes_kv_cache_update is False",
        remove_when="with the _determine_batch_execution_and_padding patch",
        names=("forward_includes_kv_cache_update",),
    ),
    VllmInternal(
        symbol=f"{RUNNER}.take_draft_token_ids",
        kind="patch",
        process=("worker",),
        why="a step whose draft lists are all empty leaves the scheduler nothing to update, yet vLLM's "
        "post-step hands it one empty list per request (Scheduler.update_draft_token_ids walks them: 45 us a "
        "step at 32 requests on CPU, measured)",
        how="wrap: None when runner._draft_token_ids is the drafter's handed_no_drafts (the all-empty lists "
        "DFlashProposer.propose_unverified_step returned this step); else vLLM's method. The scheduler already "
        "cleared the spec_token_ids of every request it scheduled (Scheduler.schedule), so nothing differs",
        remove_when="vLLM skips empty draft lists itself",
        params=("self",),
        source_has=("if not self.num_spec_tokens or not self._draft_token_req_ids:",),
        used_by="vllm.v1.engine.core:EngineCore.post_step",
        usage=("draft_token_ids = self.model_executor.take_draft_token_ids()",
               "if draft_token_ids is not None:"),
        install=_no_scheduler_update_for_steps_without_drafts,
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.scheduler:Scheduler",
        kind="mirror",
        process=("engine",),
        why="the take_draft_token_ids patch hands no draft lists for a step without drafts: that is only the "
        "same as empty lists if scheduling a request already emptied its spec_token_ids",
        how="Scheduler.schedule sets a scheduled request's spec_token_ids to [] once its scheduled drafts are "
        "taken",
        remove_when="with the take_draft_token_ids patch",
        source_has=("request.spec_token_ids = []",
                    "# New spec tokens will be set in `update_draft_token_ids` before the"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}._prepare_inputs",
        kind="patch",
        process=("worker",),
        why="a step where no request has a draft to verify (adaptive speculation off for the step, or a "
        "prefill) is a plain step: vLLM 0.32 still builds speculative metadata for it and sends its one token "
        "per request through the rejection sampler; the plain path samples what the rejection sampler would "
        "with nothing to verify, for less",
        how="wrap: when scheduler_output.scheduled_spec_decode_tokens is empty and the drafter is ours with "
        "plain_steps_without_drafts (not on hybrid targets, whose recurrent layers read the per-step draft "
        "counts only the speculative branch fills), run vLLM's method with runner.speculative_config None for "
        "the call: spec_decode_metadata None, logits at each request's last token, vLLM's plain sampler; "
        "vLLM's drafting glue has a branch for spec_decode_metadata None",
        remove_when="vLLM skips speculative metadata for steps without drafts",
        params=("self", "scheduler_output", "num_scheduled_tokens"),
        source_has=("use_spec_decode = self.speculative_config is not None",
                    "scheduler_output.scheduled_spec_decode_tokens.items()"),
        used_by=f"{RUNNER}.execute_model",
        usage=("self._prepare_inputs(",),
        install=_plain_inputs_for_steps_without_drafts,
    ),
    VllmInternal(
        symbol=f"{RUNNER}._preprocess",
        kind="patch",
        process=("worker",),
        why="with a speculative config vLLM clamps every step's input ids (speculative placeholders, -1, before "
        "the embedding lookup): a step that schedules no drafts has no placeholder, and the in-place op was "
        "~9 us of a coasting step at 32 requests (float32, AVX-512 EPYC)",
        how="wrap: when scheduler_output.scheduled_spec_decode_tokens is empty and the drafter is ours with "
        "plain_steps_without_drafts, run vLLM's method with runner.speculative_config None for the call (the "
        "clamp is its only reader there)",
        remove_when="vLLM clamps only where placeholders were scheduled",
        params=("self", "scheduler_output", "num_input_tokens", "intermediate_tensors"),
        source_has=("if self.speculative_config is not None:\n            self.input_ids.gpu[:num_input_tokens]"
                    ".clamp_(min=0)",),
        used_by=f"{RUNNER}.execute_model",
        usage=("self._preprocess(",),
        install=_no_placeholder_clamp_for_steps_without_drafts,
    ),
    VllmInternal(
        symbol=f"{RUNNER}._get_positions",
        kind="call",
        process=("worker",),
        why="a step without drafting queues its tokens' context at their positions, as vLLM's glue hands "
        "them to propose() (target_positions)",
        how="runner._get_positions(num_scheduled_tokens)",
        remove_when="with the propose_draft_token_ids patch",
        params=("self", "num_tokens"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}._get_positions",
        kind="mirror",
        process=("worker",),
        why="a step that continues a coasting run reads the positions _get_positions would slice straight "
        "from the runner's position buffer (a numpy view kept between steps, DFlashProposer._coast_on): "
        "without M-RoPE they are its first num_tokens entries",
        how="runner.positions.numpy()[:num_tokens] unless runner.uses_mrope",
        remove_when="with the propose_draft_token_ids patch",
        source_has=("if self.uses_mrope:", "return self.positions[:num_tokens]"),
    ),
    VllmInternal(
        symbol="vllm.v1.core.sched.output:SchedulerOutput",
        kind="read",
        process=("worker",),
        why="the step's new tokens are the rows of the target pass whose hidden states become context",
        how="scheduler_output.total_num_scheduled_tokens (vLLM's glue slices the aux hidden states by it)",
        remove_when="with the propose_draft_token_ids patch",
        names=("total_num_scheduled_tokens",),
    ),
    VllmInternal(
        symbol="vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
        kind="read",
        process=("worker",),
        why="a step verified drafts only if its speculative metadata has some (vLLM 0.32 builds the metadata "
        "for every step of a speculative engine)",
        how="spec_decode_metadata is None or spec_decode_metadata.max_spec_len == 0: nothing verified",
        remove_when="with the propose_draft_token_ids patch",
        names=("max_spec_len",),
    ),
    VllmInternal(
        symbol="vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
        kind="patch",
        process=("frontend",),
        why="Model Runner V2 (the CUDA default) has its own DFlash speculator; listing dflash as unsupported "
        "there keeps it on the V1 runner, where the proposer patch applies",
        how="wrap: append a reason when speculative_config.method == 'dflash'",
        remove_when="the plugin hooks Model Runner V2's speculator too",
        params=("self",),
        used_by="vllm.config.vllm:VllmConfig",
        usage=("self._get_v2_model_runner_unsupported_features()",),
        install=_keep_v1_runner_for_dflash,
    ),
    VllmInternal(
        symbol="vllm.engine.arg_utils:EngineArgs.create_speculative_config",
        kind="patch",
        process=("frontend",),
        why="SpeculativeConfig needs `model` and `num_speculative_tokens` for dflash and forbids unknown keys: "
        "fill a missing draft (known-targets table) and count (block_size - 1), validate the draft as a "
        "ValueError naming the field, translate our draft_sample key into vLLM's draft_sample_method; take "
        "out our adaptive key, record it in the draft's dflash_config for the workers, turn async scheduling "
        "off for it and set up the engine's adaptive-metrics folder before the engine processes start",
        how="wrap (serving.draft_resolution.complete_speculative_config): complete the dict before vLLM's "
        "method builds SpeculativeConfig; afterwards spell out the draft's target_layer_ids in its hf_config "
        "(the runner reads them) and attach the validated DFlashConfig to the SpeculativeConfig",
        remove_when="never: the config completion and validation are the plugin's",
        params=("self", "target_model_config", "target_parallel_config"),
        used_by="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        usage=("self.create_speculative_config(",),
        install=_complete_dflash_speculative_config,
        plugin_only=False,
    ),
    VllmInternal(
        symbol="vllm.engine.arg_utils:EngineArgs",
        kind="read",
        process=("frontend",),
        why="vLLM merges --speculative-method/-model/-tokens into the dict inside create_speculative_config; "
        "the config patch looks at them to see the user's whole config, and sets async_scheduling for "
        "adaptive speculation",
        how="read self.<name> inside the patched method; set self.async_scheduling",
        remove_when="with the create_speculative_config patch",
        names=("speculative_config", "spec_method", "spec_model", "spec_tokens", "async_scheduling"),
    ),
    # -------------------------------------------------------- proposer ----
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.propose",
        kind="implement",
        ours="vllm_dflash.serving.proposer:DFlashProposer.propose",
        process=("worker",),
        why="the runner hands every drafter the target's hidden states and attention metadata here",
        how="DFlashProposer.propose takes every argument by the same names",
        remove_when="never (it is the proposer API)",
        params=("self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
                "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings"),
        used_by=RUNNER,
        usage=("self.drafter.propose(",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.dummy_run",
        kind="implement",
        ours="vllm_dflash.serving.proposer:DFlashProposer.dummy_run",
        process=("worker",),
        why="memory profiling and warm-up run the drafter once with the largest batch",
        how="DFlashProposer.dummy_run computes context K/V and one query-block forward",
        remove_when="never (it is the proposer API)",
        params=("self", "num_tokens", "use_cudagraphs", "is_graph_capturing", "slot_mappings"),
        used_by=RUNNER,
        usage=("self.drafter.dummy_run(",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.load_model",
        kind="implement",
        ours="vllm_dflash.serving.proposer:DFlashProposer.load_model",
        process=("worker",),
        why="the runner loads the drafter after the target: the draft shares the target's embedding and LM head",
        how="DrafterBase.load_model: get_model with the draft's config, the draft's attention layers are the "
        "ones the target lacks; DFlashProposer checks the draft loaded as DFlashDraftForCausalLM",
        remove_when="never (it is the proposer API)",
        params=("self", "target_model"),
        used_by=RUNNER,
        usage=("self.drafter.load_model(",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.initialize_attn_backend",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.initialize_attn_backend",
        process=("worker",),
        why="once the KV cache is laid out the runner hands the drafter its groups, to build the draft layers' "
        "attention metadata builders",
        how="one vLLM AttentionGroup per backend among the draft layers, in their (single) KV cache group",
        remove_when="never (it is the proposer API)",
        params=("self", "kv_cache_config", "kernel_block_sizes"),
        used_by=RUNNER,
        usage=("self.drafter.initialize_attn_backend(kv_cache_config, kernel_block_sizes)",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.initialize_cudagraph_keys",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.initialize_cudagraph_keys",
        process=("worker",),
        why="the runner asks every hidden-state drafter for its CUDA graph keys",
        how="nothing: the draft runs eagerly",
        remove_when="never (it is the proposer API)",
        params=("self", "cudagraph_mode"),
        used_by=RUNNER,
        usage=("self.drafter.initialize_cudagraph_keys(cudagraph_mode)",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.prepare_next_token_ids_padded",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.prepare_next_token_ids_padded",
        process=("worker",),
        why="the runner calls it every speculative step, drafting or not; on CPU vLLM's looks up every "
        "request's fallback token in a Python loop that rebuilds input_batch.req_ids per row and round-trips "
        "each tensor through int64 for its kernel: in a no-draft step at 64 requests it cost more than the "
        "rest of drafting but the context write",
        how="on CPU in numpy, fallback tokens looked up only for the rows that use them (discarded or without a "
        "valid sample); on an accelerator in tensor ops with every row's fallback read on the host "
        "(tests/unit/test_next_token_ids.py: both equal vLLM's kernel)",
        remove_when="never (it is the proposer API)",
        params=("self", "sampled_token_ids", "requests", "gpu_input_batch", "discard_request_mask"),
        used_by=f"{RUNNER}.propose_draft_token_ids",
        usage=("self.drafter.prepare_next_token_ids_padded(",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.prepare_inputs_padded",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.prepare_inputs_padded",
        process=("worker",),
        why="after verification the runner asks the drafter for the step's attention metadata and each "
        "request's rejected drafts, which it passes back to propose()",
        how="rejected = drafts + 1 - valid samples (0 without drafts), as vLLM's kernel "
        "(tests/unit/test_next_token_ids.py: equal to vLLM's CPU kernel)",
        remove_when="never (it is the proposer API)",
        params=("self", "common_attn_metadata", "spec_decode_metadata", "valid_sampled_tokens_count"),
        used_by=f"{RUNNER}.propose_draft_token_ids",
        usage=("self.drafter.prepare_inputs_padded(",),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.take_last_draft_probs",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.take_last_draft_probs",
        process=("worker",),
        why="sampled drafts leave their distributions q for the rejection sampler",
        how="returns the [B, q, V] probabilities of the last sampled block, or None (argmax drafts)",
        remove_when="never (it is the proposer API)",
        params=("self",),
        used_by=f"{RUNNER}.propose_draft_token_ids",
        usage=('hasattr(self.drafter, "take_last_draft_probs")', "self.drafter.take_last_draft_probs()"),
    ),
    VllmInternal(
        symbol=f"{BASE_PROPOSER}.set_eplb_state",
        kind="implement",
        ours="vllm_dflash.serving.drafter_base:DrafterBase.set_eplb_state",
        process=("worker",),
        why="with expert load balancing the runner hands a drafter with MoE layers its state (a DFlash draft "
        "has none; the runner only calls it for one)",
        how="kept as eplb_state",
        remove_when="never (it is the proposer API)",
        params=("self", "eplb_state"),
        used_by=RUNNER,
        usage=("self.drafter.set_eplb_state(self.eplb_state)",),
    ),
    VllmInternal(
        symbol=RUNNER,
        kind="mirror",
        process=("worker",),
        why="attributes the runner reads on a hidden-state drafter, which DrafterBase sets: the draft layers' "
        "KV cache group and attention groups, and whether it takes multimodal embeddings",
        how="DrafterBase.__init__ / initialize_attn_backend set kv_cache_gid, draft_attn_groups, "
        "supports_mm_inputs (False: the draft is text-only)",
        remove_when="never (it is the proposer API)",
        source_has=("self.drafter.kv_cache_gid == kv_cache_gid", 'getattr(self.drafter, "draft_attn_groups", [])',
                    "self.supports_mm_inputs and self.drafter.supports_mm_inputs"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.model_loader:get_model",
        kind="call",
        process=("worker",),
        why="the draft loads through vLLM's loader (weights, quantisation, the registry's DFlashDraftModel)",
        how="get_model(vllm_config=draft config, model_config=speculative_config.draft_model_config, "
        "load_config=get_draft_load_config(draft config)), inside set_model_tag('dflash_draft')",
        remove_when="never (it is vLLM's loader)",
        params=("vllm_config", "model_config", "load_config"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.model_loader.utils:get_draft_load_config",
        kind="call",
        process=("worker",),
        why="the draft's load config (its own weights path and format)",
        how="get_draft_load_config(draft_vllm_config)",
        remove_when="never (it is vLLM's loader)",
        params=("vllm_config",),
    ),
    VllmInternal(
        symbol="vllm.compilation.backends:set_model_tag",
        kind="call",
        process=("worker",),
        why="the draft's torch.compile artefacts must not share the target's cache directory",
        how="with set_model_tag('dflash_draft'): get_model(...)",
        remove_when="never (it is how vLLM separates compiled models)",
        params=("tag",),
    ),
    VllmInternal(
        symbol="vllm.config:get_layers_from_vllm_config",
        kind="call",
        process=("worker",),
        why="the draft's attention layers are the ones registered after the target's",
        how="get_layers_from_vllm_config(vllm_config, AttentionLayerBase) before and after loading the draft",
        remove_when="never (it is vLLM's layer registry)",
        params=("vllm_config", "layer_type"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.utils:AttentionGroup",
        kind="call",
        process=("worker",),
        why="the draft layers' attention metadata builders (the runner reads draft_attn_groups too)",
        how="AttentionGroup(backend=, layer_names=, kv_cache_spec=, kv_cache_group_id=)"
        ".create_metadata_builders(vllm_config, device, kernel_block_size=)",
        remove_when="never (it is vLLM's attention-group type)",
        params=("backend", "layer_names", "kv_cache_spec", "kv_cache_group_id"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.utils:AttentionGroup.create_metadata_builders",
        kind="call",
        process=("worker",),
        why="see AttentionGroup",
        how="attn_group.create_metadata_builders(vllm_config, device, kernel_block_size=...)",
        remove_when="never (it is vLLM's attention-group type)",
        params=("vllm_config", "device", "kernel_block_size"),
    ),
    VllmInternal(
        symbol="vllm.v1.worker.utils:AttentionGroup.build_metadata_for_drafting",
        kind="call",
        process=("worker",),
        why="the query block's attention metadata comes from vLLM's builder for the draft's attention groups",
        how="attn_group.build_metadata_for_drafting(common_attn_metadata=, draft_index=0)",
        remove_when="never (it is how a drafter gets attention metadata)",
        params=("common_attn_metadata", "draft_index"),
    ),
    VllmInternal(
        symbol="vllm.config.speculative:SpeculativeConfig",
        kind="read",
        process=("worker",),
        why="the drafter's options",
        how="disable_padded_drafter_batch and use_local_argmax_reduction (refused with a message), "
        "rejection_sample_method + draft_sample_method (probabilistic drafting), attention_backend and "
        "kv_cache_dtype (the draft's own), draft_model_config",
        remove_when="never (it is vLLM's speculative config)",
        names=("disable_padded_drafter_batch", "use_local_argmax_reduction", "rejection_sample_method",
               "draft_sample_method", "attention_backend", "kv_cache_dtype", "draft_model_config",
               "num_speculative_tokens"),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backend:CommonAttentionMetadata",
        kind="call",
        process=("worker",),
        why="the query block gets its own non-causal attention metadata",
        how="CommonAttentionMetadata(...) with these fields, causal=False",
        remove_when="never (it is vLLM's attention-metadata type)",
        params=("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs",
                "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping",
                "causal"),
    ),
    VllmInternal(
        symbol="vllm.forward_context:set_forward_context",
        kind="call",
        process=("worker",),
        why="vLLM's Attention layers read their metadata and slot mapping from the forward context",
        how="set_forward_context(per_layer_metadata, vllm_config, num_tokens=, slot_mapping=)",
        remove_when="never (it is how vLLM layers get their context)",
        params=("attn_metadata", "vllm_config", "num_tokens", "slot_mapping"),
    ),
    VllmInternal(
        symbol=f"{RUNNER}._get_eagle3_aux_layers_from_config",
        kind="mirror",
        process=("worker",),
        why="the runner captures target hidden states after the layers dflash_config.target_layer_ids name "
        "(id + 1: the output of 0-based layer id); the config patch spells out ids a draft leaves to "
        "z-lab's default rule, and vllm_dflash.config states the same semantics",
        how="vllm_dflash.config (target_layer_ids semantics), the create_speculative_config patch",
        ours="vllm_dflash.config:parse_draft_config",
        remove_when="never (it is the checkpoint format both sides read)",
        source_has=('i + 1 for i in (dflash_config.get("target_layer_ids") or [])',),
    ),
    # ------------------------------------------------------ draft model ----
    VllmInternal(
        symbol="vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_name",
        kind="call",
        process=("worker",),
        why="the context-KV writer picks the cache layout of the backend that will read it by name",
        how="serving.context_kv.CACHE_LAYOUTS: 'CPU_ATTN' -> 'cpu'",
        remove_when="vLLM exposes a cache-layout descriptor per backend",
        returns="CPU_ATTN",
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.flash_attn:FlashAttentionBackend.get_name",
        kind="call",
        process=("worker",),
        why="as CPU_ATTN: FlashAttention caches take layout 'flash'",
        how="serving.context_kv.CACHE_LAYOUTS: 'FLASH_ATTN' -> 'flash'",
        remove_when="vLLM exposes a cache-layout descriptor per backend",
        returns="FLASH_ATTN",
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.attention:Attention",
        kind="read",
        process=("worker",),
        why="context K/V go straight into each draft layer's paged cache, outside its forward",
        how="layer.kv_cache (the bound cache tensor), layer.impl, layer.get_attn_backend()",
        remove_when="vLLM offers a public 'store K/V at slots' call per attention layer",
        names=("kv_cache", "impl", "get_attn_backend"),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.do_kv_cache_update",
        kind="call",
        process=("worker",),
        why="backends without a layout of our own (Triton, FlashInfer, ...) store context K/V with their "
        "own cache writer; Triton's stands for all (FlashInfer's takes the same parameters but needs "
        "flashinfer installed to import)",
        how="attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slot_mapping)",
        remove_when="vLLM offers a public 'store K/V at slots' call per attention layer",
        params=("layer", "key", "value", "kv_cache", "slot_mapping"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding",
        kind="read",
        process=("worker",),
        why="context keys are rotated outside the compiled graph, where CustomOp dispatch would pick the "
        "slow native path; the fused op reads the cos/sin table itself",
        how="rope.forward_cpu / forward_cuda / forward_native(positions, keys, None); rope.cos_sin_cache, "
        "rope.is_neox_style; a rope is a 'table rope' when it keeps RotaryEmbedding's forward methods",
        remove_when="never while context K/V are written outside the model's forward",
        names=("forward_cpu", "forward_cuda", "forward_native", "forward_static", "forward",
               "cos_sin_cache", "is_neox_style"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
        kind="call",
        process=("worker",),
        why="see RotaryEmbedding: forward_cpu and forward_cuda take the same arguments",
        how="rope.forward_<platform>(positions, keys, None)[0]",
        remove_when="never while context K/V are written outside the model's forward",
        params=("positions", "query", "key"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_static",
        kind="mirror",
        process=("worker",),
        why="ops.store_context_kv_fused and its torch reference restate the rotation of a table rope",
        how="cos_sin = cos_sin_cache[positions], cat(cos, sin) halves; neox: half split, else interleaved",
        ours="vllm_dflash.ops.reference:rms_norm_rope_ref",
        remove_when="never while the fused op rotates context keys",
        source_has=("cos_sin = cos_sin_cache.index_select(0, positions)", "cos, sin = cos_sin.chunk(2, dim=-1)"),
    ),
    VllmInternal(
        symbol="vllm.model_executor.layers.layernorm:RMSNorm",
        kind="read",
        process=("worker",),
        why="hidden_norm runs as one native call (ops.rms_norm) when it is plain RMSNorm math",
        how="norm.has_weight, norm.variance_size_override is None, norm.weight, norm.variance_epsilon",
        remove_when="never while hidden_norm runs outside the compiled graph",
        names=("has_weight", "variance_size_override", "weight", "variance_epsilon"),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.cpu_attn:_get_attn_isa",
        kind="mirror",
        process=("worker",),
        why="the CPU cache packing depends on the ISA vLLM picks; ops.resolve_kv_layout restates the rule",
        how="head_size % 32 != 0 and % 16 == 0 -> vec16; AMX + bf16 + block_size % 32 == 0 -> amx; else vec/vec16",
        ours="vllm_dflash.ops:resolve_kv_layout",
        remove_when="vLLM records the ISA on the cache or layer in a public place",
        source_has=('head_size % 32 != 0 and head_size % 16 == 0', 'return "vec16"',
                    "torch.cpu._is_amx_tile_supported()",
                    "supports_amx and dtype in (torch.bfloat16,) and block_size % 32 == 0", 'return "amx"'),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
        kind="mirror",
        process=("worker",),
        why="ops.store_context_kv_layer's 'cpu' layouts pack a page as vLLM's CPU attention reads it; padded "
        "target passes and query blocks (serving.gemm_rows) rely on it computing only the first "
        "num_actual_tokens rows",
        how="per (block, head): block_size*2 rows of head_size, K part then V part; rows past num_actual_tokens "
        "are padding, their outputs dropped",
        ours="vllm_dflash.ops.reference:store_context_kv_layer_ref",
        remove_when="vLLM exposes a cache writer for arbitrary slots (the layout); with the "
        "_determine_batch_execution_and_padding patch (the rows)",
        source_has=("kv_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))",
                    "key_cache, value_cache = kv_cache.chunk(2, dim=2)",
                    "num_actual_tokens = attn_metadata.num_actual_tokens", "query[:num_actual_tokens]"),
    ),
    VllmInternal(
        symbol="vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
        kind="mirror",
        process=("worker",),
        why="ops.store_context_kv_layer's 'flash' layout is the one FlashAttention reads",
        how="kv_cache[b, h, o, :d] = K, kv_cache[b, h, o, d:] = V",
        ours="vllm_dflash.ops.reference:store_context_kv_layer_ref",
        remove_when="vLLM exposes a cache writer for arbitrary slots",
        source_has=("key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)",),
    ),
]
