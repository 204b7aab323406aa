"""vLLM internals of the verification path: the rejection sampler and min-p
(patches and what DFlashRejectionSampler calls, reads or mirrors)."""

from __future__ import annotations

from vllm_dflash.patches.internal import VllmInternal, wrap_once

REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler:RejectionSampler"
RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
NEVER = "never: the verifier is the plugin's"


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

    wrap_once(SamplingParams, "_validate_spec_decode", make)


def _keep_min_p_processor_with_dflash_verifier() -> None:
    import vllm.v1.worker.gpu_model_runner as runner_module

    def make(original):
        def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
            from vllm.v1.sample.logits_processor import LogitsProcessors, MinPLogitsProcessor

            from vllm_dflash.verifier.selection import use_dflash_verifier

            procs = original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
            if is_pooling_model or not use_dflash_verifier(vllm_config.speculative_config):
                return procs
            # The bonus token's Sampler applies it; DFlashRejectionSampler reads its per-request values.
            return LogitsProcessors([*procs.all, MinPLogitsProcessor(vllm_config, device, is_pin_memory)])

        return build_logitsprocs

    wrap_once(runner_module, "build_logitsprocs", make)


ENTRIES: list[VllmInternal] = [
    # ------------------------------------------------------------ patches --
    VllmInternal(
        symbol="vllm.v1.worker.gpu_model_runner:RejectionSampler",
        kind="patch",
        process=("worker",),
        why="the runner builds RejectionSampler(sampler, spec_config, device) for every speculative method and "
        "calls its forward and static parse_output; our subclass verifies DFlash with the plugin's kernels and "
        "is vLLM's sampler otherwise (it decides per config: VLLM_DFLASH_VERIFIER, VLLM_DFLASH_IMPL), so it "
        "is installed even with VLLM_DFLASH_IMPL=vllm",
        how="rebind the runner module's name to vllm_dflash.verifier.sampler.DFlashRejectionSampler",
        remove_when="vLLM's rejection sampler applies min-p at draft positions and verifies sampled drafts "
        "correctly on CPU (vLLM 0.32's CPU expand_batch_to_tokens returns uninitialized temperatures)",
        upstream="vllm-project/vllm#42744 (min-p skipped at draft positions), "
        "vllm-project/vllm#42638 (expand_batch_to_tokens on CPU)",
        params=("self", "sampler", "spec_config", "device"),
        original="vllm.v1.sample.rejection_sampler:RejectionSampler",
        ours="vllm_dflash.verifier.sampler:DFlashRejectionSampler",
        used_by=RUNNER,
        usage=("self.rejection_sampler = RejectionSampler(", "self.rejection_sampler("),
        install=_install_verifier,
        plugin_only=False,
    ),
    VllmInternal(
        symbol="vllm.sampling_params:SamplingParams._validate_spec_decode",
        kind="patch",
        process=("frontend",),
        why="vLLM rejects min_p with speculative decoding because its rejection sampler skips min-p at draft "
        "positions; ours applies it, so min_p is allowed when ours verifies",
        how="wrap: return early when our verifier serves; logit_bias then gets its own error naming the field",
        remove_when="vLLM's rejection sampler applies min-p at draft positions",
        upstream="vllm-project/vllm#42744, vllm-project/vllm#42802 (the guard came with #31982)",
        params=("self", "speculative_config"),
        used_by="vllm.sampling_params:SamplingParams",
        usage=("self._validate_spec_decode(speculative_config)",),
        install=_allow_min_p_with_dflash_verifier,
        plugin_only=False,
    ),
    VllmInternal(
        symbol="vllm.v1.worker.gpu_model_runner:build_logitsprocs",
        kind="patch",
        process=("worker",),
        why="under speculative decoding vLLM builds only the min-tokens processor, so min_p would be ignored; "
        "with our verifier the min-p processor is kept (the bonus token's Sampler applies it, our verifier "
        "reads its per-request values)",
        how="wrap: append MinPLogitsProcessor(vllm_config, device, is_pin_memory) when our verifier serves",
        remove_when="with the _validate_spec_decode patch",
        upstream="vllm-project/vllm#42744",
        params=("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs"),
        used_by=RUNNER,
        usage=("build_logitsprocs(",),
        install=_keep_min_p_processor_with_dflash_verifier,
        plugin_only=False,
    ),
    # ------------------------------------------------- rejection sampler ----
    VllmInternal(
        symbol=f"{REJECTION_SAMPLER}.forward",
        kind="override",
        process=("worker",),
        why="the runner verifies every speculative step through it",
        how="DFlashRejectionSampler.forward: ours for DFlash, super().forward otherwise",
        ours="vllm_dflash.verifier.sampler:DFlashRejectionSampler.forward",
        remove_when=NEVER,
        params=("self", "metadata", "draft_probs", "logits", "sampling_metadata"),
        used_by=RUNNER,
        usage=("self.rejection_sampler(",),
    ),
    VllmInternal(
        symbol=f"{REJECTION_SAMPLER}.apply_logits_processors",
        kind="call",
        process=("worker",),
        why="penalties, bad words and min-tokens at draft positions stay vLLM's",
        how="self.apply_logits_processors(target_logits, sampling_metadata, metadata)",
        remove_when="never while vLLM's logits processors apply",
        params=("logits", "sampling_metadata", "metadata"),
    ),
    VllmInternal(
        symbol=f"{REJECTION_SAMPLER}._get_logprobs_tensors",
        kind="call",
        process=("worker",),
        why="logprobs of the emitted tokens are computed exactly as vLLM's sampler does",
        how="self._get_logprobs_tensors(max_num_logprobs, metadata, logits, target_logits, bonus_logits, "
        "output_token_ids)",
        remove_when="vLLM exposes the logprobs computation publicly",
        params=("max_num_logprobs", "metadata", "logits", "target_logits", "bonus_logits", "sampled_token_ids"),
    ),
    VllmInternal(
        symbol=REJECTION_SAMPLER,
        kind="read",
        process=("worker",),
        why="the bonus token is vLLM's Sampler's; logprobs follow the configured logprobs mode",
        how="self.sampler(...), self.is_processed_logprobs_mode",
        remove_when="never while the subclass wraps vLLM's sampler",
        names=("sampler", "is_processed_logprobs_mode"),
    ),
    VllmInternal(
        symbol="vllm.v1.sample.sampler:Sampler.forward",
        kind="call",
        process=("worker",),
        why="the bonus token is sampled by vLLM's Sampler (penalties, bad words, logit bias, seeds, ...), "
        "returning its logits for logprobs; a step where no request has a draft (metadata.max_spec_len == 0) "
        "is the Sampler's alone, as without speculation",
        how="self.sampler(logits=, sampling_metadata=, predict_bonus_token=True, logprobs_mode_override=); "
        "with no drafts, self.sampler(logits=, sampling_metadata=, predict_bonus_token=True)",
        remove_when="never while the bonus token is vLLM's",
        params=("logits", "sampling_metadata", "predict_bonus_token", "logprobs_mode_override"),
    ),
    VllmInternal(
        symbol="vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor",
        kind="read",
        process=("worker",),
        why="min-p at draft positions uses each request's value, which only vLLM's processor holds",
        how="processor.min_p_count, processor.min_p ([B] tensor) of the processor in "
        "sampling_metadata.logitsprocs.argmax_invariant",
        remove_when="SamplingMetadata carries min_p itself",
        names=("min_p", "min_p_count"),
    ),
    VllmInternal(
        symbol="vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor.__init__",
        kind="call",
        process=("worker",),
        why="the build_logitsprocs patch adds the processor vLLM leaves out under speculation",
        how="MinPLogitsProcessor(vllm_config, device, is_pin_memory)",
        remove_when="with the build_logitsprocs patch",
        params=("vllm_config", "device", "is_pin_memory"),
    ),
    VllmInternal(
        symbol="vllm.v1.sample.rejection_sampler:generate_uniform_probs",
        kind="mirror",
        process=("worker",),
        why="verifier.rejection.draw_noise draws uniforms as vLLM does (float64, a seeded request's slice from "
        "its generator, none for requests without drafts), so seeded runs match vLLM's sampler",
        how="draw_noise",
        ours="vllm_dflash.verifier.rejection:draw_noise",
        remove_when="never (our verifier draws its own noise)",
        source_has=("dtype=torch.float64",),
    ),
    VllmInternal(
        symbol="vllm.v1.sample.sampler:Sampler.sample",
        kind="mirror",
        process=("worker",),
        why="verifier.sampling_params applies temperature (greedy rows divided by 1, eps 1e-5), then min-p, "
        "then top-k/top-p at draft positions, in vLLM's order, so speculation stays lossless",
        how="verifier.sampling_params.process_logits",
        ours="vllm_dflash.verifier.sampling_params:process_logits",
        remove_when="never (the order is what lossless means)",
        source_has=("logits = self.apply_temperature(",),
    ),
]
