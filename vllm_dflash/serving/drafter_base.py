"""What vLLM 0.32's V1 runner calls on a hidden-state drafter, written for ours.

The runner drives any drafter of method "dflash" through one protocol: it loads
it (`load_model`), gives it its attention groups once the KV cache exists
(`initialize_attn_backend`, `kv_cache_gid`, `draft_attn_groups`), warms it up
(`dummy_run`, `initialize_cudagraph_keys`), and every step asks it for the next
tokens and the rejection counts (`prepare_next_token_ids_padded`,
`prepare_inputs_padded`) before `propose` and `take_last_draft_probs`. vLLM's
generic `SpecDecodeBaseProposer` implements it for every method, but its module
imports vLLM's in-tree DFlash model, which the plugin must never load; so the
plugin answers the protocol itself (each call is in the register,
`vllm_dflash.patches.serving`, kind "implement"), with only what a DFlash draft
needs: one text-only model, eager, on the padded batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.utils import get_draft_load_config
from vllm.model_executor.models.interfaces import supports_multimodal
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.worker.utils import AttentionGroup

from vllm_dflash.serving.draft_resolution import refuse_unsupported_options

DRAFT_MODEL_TAG = "dflash_draft"  # the draft's torch.compile cache lives apart from the target's


class DrafterBase:
    """The runner-facing half of the DFlash proposer: configuration, loading, attention
    groups, per-step bookkeeping. `DFlashProposer` adds drafting."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        spec = vllm_config.speculative_config
        refuse_unsupported_options(lambda option: getattr(spec, option, None))
        if spec.draft_model_config.uses_mrope:
            raise ValueError(
                f"the DFlash draft {spec.model} uses M-RoPE; vllm-dflash's draft takes 1-D positions: use a "
                "draft config without rope_scaling.mrope_section"
            )
        self.vllm_config = vllm_config
        self.speculative_config = spec
        self.device = device
        self.dtype = vllm_config.model_config.dtype
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_batch_size = vllm_config.scheduler_config.max_num_seqs
        max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # The draft is text-only: the runner gathers no multimodal embeddings for it.
        self.supports_mm_inputs = False
        # Set by initialize_attn_backend, once the KV cache is laid out.
        self.draft_attn_groups: list[AttentionGroup] = []
        self.kv_cache_gid = -1
        self.block_size = -1
        self.draft_attn_layer_names: set[str] = set()
        # Warm-up inputs (dummy_run).
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        # vLLM's probabilistic drafting: sampled drafts leave their distributions for the
        # rejection sampler, which the runner fetches through take_last_draft_probs().
        self.draft_probs_enabled = (spec.rejection_sample_method == "standard"
                                    and spec.draft_sample_method == "probabilistic")
        self.last_draft_probs: torch.Tensor | None = None
        self.eplb_state = None

    # ------------------------------------------------------------ loading --
    def _create_draft_vllm_config(self) -> VllmConfig:
        """The target's config with the draft's own attention backend (auto-selected unless
        the speculative config names one) attending non-causally, and its KV cache dtype."""
        spec, config = self.speculative_config, self.vllm_config
        attention = dataclasses.replace(config.attention_config, backend=spec.attention_backend, use_non_causal=True)
        cache = config.cache_config
        if spec.kv_cache_dtype is not None:
            cache = dataclasses.replace(cache, cache_dtype=spec.kv_cache_dtype)
        draft = dataclasses.replace(config, attention_config=attention, cache_config=cache)
        arch = draft.model_config.model_arch_config
        if getattr(arch, "is_mm_prefix_lm", False):  # the draft is text-only
            draft.model_config.model_arch_config = dataclasses.replace(arch, is_mm_prefix_lm=False)
        return draft

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Load the draft, find its attention layers (the ones the target does not have), and
        give it the target's embedding and LM head."""
        from vllm.compilation.backends import set_model_tag

        target_layers = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase))
        draft_config = self._create_draft_vllm_config()
        with set_model_tag(DRAFT_MODEL_TAG):
            self.model = get_model(vllm_config=draft_config, model_config=self.speculative_config.draft_model_config,
                                   load_config=get_draft_load_config(draft_config))
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self.draft_attn_layer_names = {name for name in layers.keys() - target_layers
                                       if layers[name].get_kv_cache_spec(self.vllm_config) is not None}
        target = target_model.get_language_model() if supports_multimodal(target_model) else target_model
        self._share_embedding(target)
        self._share_lm_head(target)

    def _share_embedding(self, target: torch.nn.Module) -> None:
        inner = getattr(target, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if embed is None:
            embed = getattr(inner, "embedding", None)
        if embed is None:
            raise ValueError(
                f"target {type(target).__name__} exposes no model.embed_tokens; "
                "a DFlash draft shares the target's token embedding"
            )
        self.model.model.embed_tokens = embed

    def _share_lm_head(self, target: torch.nn.Module) -> None:
        lm_head = getattr(target, "lm_head", None)
        if lm_head is None:
            raise ValueError(
                f"target {type(target).__name__} exposes no lm_head; a DFlash draft shares the target's LM head"
            )
        self.model.lm_head = lm_head

    def set_eplb_state(self, eplb_state) -> None:
        self.eplb_state = eplb_state

    # -------------------------------------------------- attention groups --
    def _draft_kv_cache_group(self, kv_cache_config: KVCacheConfig):
        """(id, group) of the one KV cache group holding the draft's attention layers."""
        found = [(gid, group) for gid, group in enumerate(kv_cache_config.kv_cache_groups)
                 if self.draft_attn_layer_names & set(group.layer_names)]
        if len(found) != 1:
            raise ValueError(
                f"the DFlash draft's attention layers fall in KV cache groups {[gid for gid, _ in found]}; they "
                "must share one (one attention metadata serves every draft layer)"
            )
        return found[0]

    def validate_same_kv_cache_group(self, kv_cache_config: KVCacheConfig) -> None:
        self._draft_kv_cache_group(kv_cache_config)

    def initialize_attn_backend(self, kv_cache_config: KVCacheConfig,
                                kernel_block_sizes: list[int] | None = None) -> None:
        """One attention group per backend among the draft's layers, in its KV cache group."""
        gid, group = self._draft_kv_cache_group(kv_cache_config)
        self.kv_cache_gid = gid
        kernel_block_size = None
        if kernel_block_sizes is not None and gid < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[gid]
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        by_backend: dict[str, AttentionGroup] = {}
        for name in sorted(self.draft_attn_layer_names):  # sorted: the same groups in every process
            backend = layers[name].get_attn_backend()
            key = backend.full_cls_name()
            if key in by_backend:
                by_backend[key].layer_names.append(name)
                continue
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            attn_group = AttentionGroup(backend=backend, layer_names=[name], kv_cache_spec=spec,
                                        kv_cache_group_id=gid)
            attn_group.create_metadata_builders(self.vllm_config, self.device, kernel_block_size=kernel_block_size)
            by_backend[key] = attn_group
        self.draft_attn_groups = list(by_backend.values())
        self.block_size = self.draft_attn_groups[0].kv_cache_spec.block_size

    def initialize_cudagraph_keys(self, cudagraph_mode) -> None:
        """The draft runs eagerly: no CUDA graph keys."""

    def build_per_group_and_layer_attn_metadata(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> tuple[list[object], dict[str, object]]:
        """(metadata per attention group, metadata per draft layer name) for one forward."""
        per_group, per_layer = [], {}
        for attn_group in self.draft_attn_groups:
            metadata = attn_group.build_metadata_for_drafting(common_attn_metadata=common_attn_metadata,
                                                              draft_index=0)
            per_group.append(metadata)
            per_layer.update(dict.fromkeys(attn_group.layer_names, metadata))
        return per_group, per_layer

    # ---------------------------------------------------- per-step inputs --
    def prepare_next_token_ids_padded(
        self,
        sampled_token_ids: torch.Tensor,
        requests: dict,
        gpu_input_batch,
        discard_request_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next token id [B] int32, valid sampled tokens [B] int32): the last sampled token
        that is neither -1 (rejected) nor outside the vocabulary, and how many there are; a
        discarded row (partial prefill) or a row with none falls back to the request's last
        token and counts 0.

        On CPU (this runs every step, drafting or not) in numpy, the fallback looked up only
        for the rows that use it; on an accelerator in tensor ops, with every row's fallback
        read on the host first so that nothing waits on the device."""
        if sampled_token_ids.device.type == "cpu":
            return next_tokens_on_host(sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        return next_tokens_on_device(sampled_token_ids, requests, gpu_input_batch, discard_request_mask)

    def prepare_inputs_padded(
        self,
        common_attn_metadata: CommonAttentionMetadata,
        spec_decode_metadata,
        valid_sampled_tokens_count: torch.Tensor,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        """(the step's attention metadata over all its tokens, the index of each request's last
        valid token, rejected drafts per request): a request that verified d drafts and has v
        valid sampled tokens rejected d + 1 - v of them (0 without drafts)."""
        cad = common_attn_metadata
        num_reqs = cad.num_reqs
        cu_drafts = spec_decode_metadata.cu_num_draft_tokens[:num_reqs]
        drafts = torch.diff(cu_drafts, prepend=cu_drafts.new_zeros(1))
        rejected = torch.where(drafts > 0, drafts + 1 - valid_sampled_tokens_count[:num_reqs], 0).to(torch.int32)
        last_valid = (cad.query_start_loc[1:num_reqs + 1] - 1 - rejected).to(torch.int32)
        starts = cad.query_start_loc_cpu
        total = int(starts[num_reqs])
        step_cad = dataclasses.replace(
            cad,
            num_actual_tokens=total,
            max_query_len=int((starts[1:num_reqs + 1] - starts[:num_reqs]).max()),
            slot_mapping=cad.slot_mapping[:total],
            causal=True,
        )
        return step_cad, last_valid, rejected

    def take_last_draft_probs(self) -> torch.Tensor | None:
        return self.last_draft_probs


def _valid_samples(sampled, vocab_size: int):
    return (sampled != -1) & (sampled < vocab_size)


def _fallback_token(requests: dict, gpu_input_batch, row: int) -> int:
    """The last token the request of `row` had before this step (what a row without a valid sample takes)."""
    return requests[gpu_input_batch.req_ids[row]].get_token_id(int(gpu_input_batch.num_tokens_no_spec[row]) - 1)


def next_tokens_on_host(sampled_token_ids: torch.Tensor, requests: dict, gpu_input_batch,
                        discard_request_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sampled = sampled_token_ids.numpy()  # numpy's per-call cost is a fraction of torch's
    batch_size, width = sampled.shape
    valid = _valid_samples(sampled, gpu_input_batch.vocab_size)
    valid_count = valid.sum(axis=1, dtype=np.int32)
    last = width - 1 - np.argmax(valid[:, ::-1], axis=1)  # last valid column (any column if none)
    next_token_ids = sampled[np.arange(batch_size), last].astype(np.int32)
    valid_count[discard_request_mask[:batch_size].numpy()] = 0
    for row in np.flatnonzero(valid_count == 0).tolist():  # discarded, or nothing valid
        next_token_ids[row] = _fallback_token(requests, gpu_input_batch, row)
    return torch.from_numpy(next_token_ids), torch.from_numpy(valid_count)


def next_tokens_on_device(sampled_token_ids: torch.Tensor, requests: dict, gpu_input_batch,
                          discard_request_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch_size, width = sampled_token_ids.shape
    fallback = torch.tensor([_fallback_token(requests, gpu_input_batch, row) for row in range(batch_size)],
                            dtype=torch.int32)
    fallback = fallback.to(sampled_token_ids.device, non_blocking=True)
    valid = _valid_samples(sampled_token_ids, gpu_input_batch.vocab_size)
    valid_count = valid.sum(dim=1, dtype=torch.int32).masked_fill(discard_request_mask[:batch_size], 0)
    last = width - 1 - valid.flip(1).to(torch.int8).argmax(dim=1)
    sampled_last = sampled_token_ids.gather(1, last.unsqueeze(1)).squeeze(1).to(torch.int32)
    return torch.where(valid_count > 0, sampled_last, fallback), valid_count
