"""vLLM 0.32 rejection sampler backed by vllm-dflash's verifier.

`vllm_dflash.patches` installs `DFlashRejectionSampler` as
`vllm.v1.worker.gpu_model_runner.RejectionSampler`. The runner builds it as
`RejectionSampler(sampler, speculative_config, device)` for every speculative
method and calls `forward(metadata, draft_probs, logits, sampling_metadata)`
each step; it also calls the static `parse_output`. The class subclasses
vLLM's, so for anything but DFlash (or with the switches below) it is vLLM's
sampler unchanged.

What stays vLLM's: the bonus token (the runner's Sampler on the bonus rows:
penalties, bad words, logit bias, allowed ids, min-p, top-k/top-p, seeds),
penalties / bad words / min-tokens on the draft positions
(`apply_logits_processors`), and logprobs. What is ours: temperature, min-p,
top-k, top-p on the draft positions (`verifier.sampling_params`; vLLM skips
min-p there), the noise (`verifier.rejection.draw_noise`, per-request
generators like vLLM) and the accept / recover step (the native op).

draft_probs: [num_draft_tokens, vocab] from the runner
(`_get_spec_decode_draft_probs`, filled by the proposer's
`take_last_draft_probs()` with vLLM's `draft_sample_method="probabilistic"`),
the distributions the drafts were sampled from; None means argmax drafts.

Which verifier serves: `verifier.selection` (VLLM_DFLASH_VERIFIER,
VLLM_DFLASH_IMPL). vLLM rejects min_p with speculative decoding; the second
verifier patch lifts that when ours serves.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_dflash.verifier import sampling_params
from vllm_dflash.verifier.rejection import draw_noise, rejection_sample
from vllm_dflash.verifier.selection import use_dflash_verifier

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers show it

def min_p_per_request(sampling_metadata: SamplingMetadata, batch_size: int) -> torch.Tensor | None:
    """[B] min-p values from vLLM's builtin MinPLogitsProcessor, None when no request sets one."""
    for processor in sampling_metadata.logitsprocs.argmax_invariant:
        if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
            min_p = processor.min_p.reshape(-1)
            if min_p.numel() != batch_size:
                raise RuntimeError(f"min-p state holds {min_p.numel()} requests, the batch {batch_size}")
            return min_p
    return None


def per_draft_token(values: torch.Tensor | None, metadata: SpecDecodeMetadata, num_tokens: int):
    """[B] -> [num_draft_tokens], without a device sync."""
    if values is None:
        return None
    cu = metadata.cu_num_draft_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    return values.repeat_interleave(counts.to(values.device), output_size=num_tokens)


# vLLM 0.32 on CPU: expand_batch_to_tokens (a Triton kernel, `_expand`, with no CPU
# backend) returns uninitialized memory, and vLLM's rejection sampler reads its
# per-token temperatures, greedy flags and top-k / top-p from it. Sampled (T > 0)
# requests then get neither the target's distribution nor sensible acceptance, greedy
# requests sharing a batch with sampled ones are verified as sampled ones (their
# outputs change), and top_k requests crash the engine (index out of bounds in
# apply_top_k_top_p_pytorch). All-greedy batches take a path without the expansion.
# Measured in README "Results" and "Serving under load"; tests/verifier/test_vllm_cpu_expand_bug.py
# fails once vLLM fixes it. vllm-dflash's verifier expands with repeat_interleave.
VLLM_CPU_SAMPLED_VERIFY_WARNING = (
    "vLLM's own rejection sampler verifies DFlash here; on CPU vLLM 0.32 reads per-token sampling "
    "parameters from uninitialized memory (expand_batch_to_tokens), so sampled (T > 0) requests do "
    "not follow the target's distribution, greedy requests batched with sampled ones get wrong tokens, "
    "and requests with top_k crash the engine. Only batches that are all greedy are verified correctly. "
    "Unset VLLM_DFLASH_VERIFIER=vllm (and VLLM_DFLASH_IMPL=vllm) to verify with vllm-dflash's sampler, "
    "which has none of these faults."
)


class DFlashRejectionSampler(RejectionSampler):
    def __init__(self, sampler, spec_config=None, device: torch.device | None = None):
        super().__init__(sampler, spec_config, device)
        self.use_dflash = use_dflash_verifier(spec_config)
        if self.use_dflash:
            logger.info("vllm-dflash verifier replaces vLLM's rejection sampler")
        elif getattr(spec_config, "method", None) == "dflash" and (device is None or torch.device(device).type == "cpu"):
            logger.warning(VLLM_CPU_SAMPLED_VERIFY_WARNING)

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        if not self.use_dflash:
            return super().forward(metadata, draft_probs, logits, sampling_metadata)
        if metadata.max_spec_len == 0:
            # No request has a draft this step (adaptive speculation chose none; vLLM 0.32
            # verifies every step of a speculative engine): the sampler alone decides, as
            # without speculation. Noise and logprobs would be drawn and gathered for nothing,
            # and no seeded request's generator is touched either way (draw_noise skips rows
            # without drafts). The runner computed logits at the bonus rows only (0..B-1).
            bonus_logits = logits if logits.shape[0] == len(metadata.num_draft_tokens) else \
                logits[metadata.bonus_logits_indices]
            return self.sampler(logits=bonus_logits, sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return self.verify_drafts(metadata, draft_probs, logits, sampling_metadata)

    def verify_drafts(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        """The bonus token, then accept / recover at the draft positions."""
        # Bonus token: vLLM's Sampler, asking for logits so logprobs can be computed below.
        bonus = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
        )

        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits if self.is_processed_logprobs_mode else raw_target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)

        num_tokens = target_logits.shape[0]
        all_greedy, all_random = sampling_metadata.all_greedy, sampling_metadata.all_random
        is_greedy = uniforms = exp_noise = greedy_tokens = None
        if not all_greedy:
            batch_size = len(metadata.num_draft_tokens)
            temperature = sampling_metadata.temperature
            is_greedy = temperature < sampling_params.SAMPLING_EPS
            expand = lambda t: per_draft_token(t, metadata, num_tokens)  # noqa: E731
            target_logits = sampling_params.process_logits(
                target_logits, expand(temperature), expand(sampling_metadata.top_k),
                expand(sampling_metadata.top_p), expand(min_p_per_request(sampling_metadata, batch_size)))
            greedy_tokens = None if all_random else expand(is_greedy)
            uniforms, exp_noise = draw_noise(
                metadata.num_draft_tokens, target_logits.shape[1], sampling_metadata.generators,
                target_logits.device)
        target = sampling_params.target_for_verifier(
            target_logits, greedy_tokens, all_greedy=all_greedy, all_random=all_random)

        output_token_ids = rejection_sample(
            metadata.draft_token_ids, metadata.cu_num_draft_tokens, target,
            None if all_greedy else draft_probs, bonus.sampled_token_ids, is_greedy,
            uniforms, exp_noise, metadata.max_spec_len)

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus.logprobs_tensors.logprobs, output_token_ids)
        return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=logprobs_tensors)
