"""vllm-dflash's DFlash proposer: replaces vLLM's whenever method == "dflash".

The runner (`GPUModelRunner`, also the CPU runner's base) builds its drafter
as `DFlashProposer(vllm_config, device, runner)` and checks it with
`isinstance(..., DFlashProposer)`; `vllm_dflash.patches` points that name at
this class. vLLM's generic `SpecDecodeBaseProposer` still supplies the
plumbing the runner calls (model loading, draft attention groups, next-token
and rejection bookkeeping, cudagraph keys); this class owns what is DFlash:

1. context: the target hidden states of the newly verified tokens only
   (rejected drafts are skipped) -> fc + hidden_norm -> per-layer K/V written
   into the draft's paged cache at those tokens' slots. Earlier context is
   already cached, so nothing is recomputed.
2. one forward pass of the query block `[bonus, MASK x k]` at positions
   `[p, p + k]`, bidirectional within the block and over all context.
3. argmax (or, with vLLM's `draft_sample_method="probabilistic"`, sampled)
   draft tokens; sampled drafts leave their probabilities q for the
   rejection sampler (vLLM's `take_last_draft_probs()`).

The drafter keeps no per-request state: everything lives in vLLM's block
tables, so chunked prefill, prefix caching, preemption and requests leaving
the batch need no bookkeeping here.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_dflash import ops, profiler
from vllm_dflash.serving.draft_model import DFlashDraftForCausalLM
from vllm_dflash.serving.draft_resolution import dflash_config_of
from vllm_dflash.verifier.draft import sample_drafts
from vllm_dflash.verifier.sampler import min_p_per_request

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers show it


class DFlashProposer(SpecDecodeBaseProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "dflash":
            raise ValueError("vllm-dflash's DFlashProposer needs speculative_config.method='dflash'")
        if spec.use_local_argmax_reduction:
            raise ValueError(
                "speculative_config.use_local_argmax_reduction is not supported by "
                "vllm-dflash's DFlash proposer; remove it"
            )
        # The draft forward takes token ids only: target features enter through
        # the context KV written by store_context_kv, not as model inputs.
        super().__init__(vllm_config, device, pass_hidden_states_to_model=False, runner=runner)
        self.dflash_config = dflash_config_of(spec)
        self.mask_token_id = self.dflash_config.mask_token_id
        self._runner = runner  # read: discard_request_mask (seeded draft sampling)
        logger.info(
            "vllm-dflash DFlash proposer: draft %s (block_size %d), %d draft tokens per step",
            spec.model,
            self.dflash_config.block_size,
            spec.num_speculative_tokens,
        )

    def _create_draft_vllm_config(self) -> VllmConfig:
        base = super()._create_draft_vllm_config()
        # The draft is text-only, and its query block needs a backend that can
        # attend non-causally.
        arch = base.model_config.model_arch_config
        if getattr(arch, "is_mm_prefix_lm", False):
            base.model_config.model_arch_config = replace(arch, is_mm_prefix_lm=False)
        return replace(base, attention_config=replace(base.attention_config, use_non_causal=True))

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        if not isinstance(model, DFlashDraftForCausalLM):
            raise ValueError(
                f"the draft loaded as {type(model).__name__}; vllm-dflash needs "
                "architectures=['DFlashDraftModel'] in the draft's config.json"
            )
        profiler.install_from_env(self)  # no-op unless VLLM_DFLASH_PROFILE_FILE is set

    def _maybe_share_embeddings(self, target_language_model: torch.nn.Module) -> None:
        inner = getattr(target_language_model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            embed = getattr(inner, "embedding", None)
        if embed is None:
            raise ValueError(
                f"target {type(target_language_model).__name__} exposes no model.embed_tokens; "
                "a DFlash draft shares the target's token embedding"
            )
        self.model.model.embed_tokens = embed

    def _maybe_share_lm_head(self, target_language_model: torch.nn.Module) -> None:
        lm_head = getattr(target_language_model, "lm_head", None)
        if lm_head is None:
            raise ValueError(
                f"target {type(target_language_model).__name__} exposes no lm_head; "
                "a DFlash draft shares the target's LM head"
            )
        self.model.lm_head = lm_head

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Peak-memory stand-in for one step: context K/V of `num_tokens`
        tokens (computed, not stored) and one query-block forward."""
        num_features = self.model.model.fc.input_size
        features = torch.zeros(num_tokens, num_features, dtype=self.dtype, device=self.device)
        self.model.store_context_kv(features, self.positions[:num_tokens], None)
        del features
        num_query = min(num_tokens, self.max_batch_size * (1 + self.num_speculative_tokens))
        with set_forward_context(None, self.vllm_config, num_tokens=num_query, slot_mapping={}):
            self.model(input_ids=self.input_ids[:num_query], positions=self.positions[:num_query])

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings=None,
    ) -> torch.Tensor:
        """Draft `num_speculative_tokens` tokens per request: [B, k] token ids.

        `target_hidden_states` is what vLLM 0.32's runner hands every
        hidden-state drafter: the captured target layers already concatenated
        per token, [T, L*D], for all T tokens of the last target pass
        (rejected drafts included). Per step: `ops.prepare_dflash_inputs`
        (context rows/positions/slots, the query block's ids/positions/slots
        and lengths), `ops.gather_hidden_states` when some rows were rejected
        (CPU), `store_context_kv` (fc and K/V GEMMs + `ops.store_context_kv_fused`),
        then vLLM's attention metadata and the query-block forward.
        """
        self.num_speculative_tokens = k = num_speculative_tokens
        self._last_draft_probs = None
        cad = common_attn_metadata
        batch_size = next_token_ids.shape[0]
        num_rows = target_positions.shape[0]
        q_len = k + 1

        # One native call for every index the step needs. On CPU the context is
        # compacted to the verified rows (the count is free on the host); on
        # CUDA rejected rows stay, with slot -1, so nothing waits on the device.
        step = ops.prepare_dflash_inputs(
            cad.query_start_loc,
            num_rejected_tokens_gpu,
            target_positions,
            cad.slot_mapping,
            next_token_ids,
            cad.block_table_tensor,
            self.block_size,
            self.mask_token_id,
            k,
            num_rows,
            self.device.type == "cpu",
        )
        if step.context_rows.shape[0] == num_rows:  # every row (rows are 0..num_rows-1): no gather
            features = target_hidden_states if target_hidden_states.shape[0] == num_rows else target_hidden_states[:num_rows]
        else:
            features = ops.gather_hidden_states([target_hidden_states], step.context_rows)
        self.model.store_context_kv(features, step.context_positions, step.context_slots)
        if k == 0:  # the cache is in sync; nothing to draft
            return torch.empty(batch_size, 0, dtype=torch.int64, device=self.device)

        if self.device.type == "cpu":  # the exact values are already on the host
            query_start_loc_cpu, seq_lens_upper = step.query_start_loc, step.seq_lens
        else:
            query_start_loc_cpu = torch.arange(batch_size + 1, dtype=torch.int32) * q_len
            upper = cad.seq_lens_cpu_upper_bound
            seq_lens_upper = None if upper is None else upper[:batch_size] + q_len
        block_cad = CommonAttentionMetadata(
            query_start_loc=step.query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=step.seq_lens,
            seq_lens_cpu_upper_bound=seq_lens_upper,
            num_reqs=batch_size,
            num_actual_tokens=batch_size * q_len,
            max_query_len=q_len,
            max_seq_len=cad.max_seq_len + q_len,
            block_table_tensor=cad.block_table_tensor[:batch_size],
            slot_mapping=step.slots,
            causal=False,
        )
        _, per_layer_metadata = self.build_per_group_and_layer_attn_metadata(block_cad)
        with set_forward_context(
            per_layer_metadata,
            self.vllm_config,
            num_tokens=batch_size * q_len,
            slot_mapping={name: step.slots for name in self._draft_attn_layer_names},
        ):
            hidden_states = self.model(input_ids=step.input_ids, positions=step.positions)
        # Row 0 of each block is the bonus token; rows 1..k predict the drafts.
        mask_hidden = hidden_states.view(batch_size, q_len, -1)[:, 1:].reshape(batch_size * k, -1)
        draft_ids = self._draft_tokens(mask_hidden, sampling_metadata)
        return draft_ids.view(batch_size, k)

    def _draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
        """Argmax drafts, or sampled drafts with vLLM's `draft_sample_method=
        "probabilistic"` (their distributions q then go to vLLM's rejection sampler)."""
        logits = self.model.compute_logits(hidden_states)
        if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
            k = self.num_speculative_tokens
            batch_size = logits.shape[0] // k
            draft_ids, probs = sample_drafts(
                logits.view(batch_size, k, -1), "sample",
                temperature=sampling_metadata.temperature, top_k=sampling_metadata.top_k,
                top_p=sampling_metadata.top_p, min_p=min_p_per_request(sampling_metadata, batch_size),
                generators=self._seeded_draft_generators(sampling_metadata, batch_size))
            self._last_draft_probs = probs
            return draft_ids.view(-1)
        if logits.dtype != torch.float32 and logits.device.type == "cpu":
            # CPU argmax over bf16/fp16 is several times slower than converting first
            # (the conversion is exact, so the result and its tie-breaking are the same).
            logits = logits.float()
        return logits.argmax(dim=-1)

    def _seeded_draft_generators(self, sampling_metadata: SamplingMetadata, batch_size: int) -> dict:
        """{row: generator} for sampled drafts: a seeded request draws its drafts from
        its own generator (vLLM draws them from the global RNG), so its output is
        reproducible. Rows whose sample is discarded this step (partial prefills)
        draw from the global RNG: vLLM rewinds only the sampler's draw there."""
        generators = sampling_metadata.generators
        if not generators or self._runner is None:
            return generators
        discarded = self._runner.discard_request_mask.np[:batch_size]
        return {i: g for i, g in generators.items() if i < batch_size and not discarded[i]}
