"""DFlash draft model on vLLM's layers, paged KV cache and weight loading.

A z-lab DFlash draft is a stack of Qwen3 decoder layers with two twists:

* Context K/V come from the *target's* hidden states (several target layers
  concatenated, projected by `fc`, normed by `hidden_norm`), not from draft
  tokens. `store_context_kv` computes them for newly verified tokens only and
  writes them into each draft layer's slot of vLLM's paged cache, so they
  persist across rounds like any other KV entry.
* The query block `[last verified token, MASK x k]` attends bidirectionally to
  itself and to all context; the proposer builds non-causal attention
  metadata for it, and vLLM's `Attention` writes the block's own K/V at the
  block's slots (the next round overwrites them with real context K/V).

Embedding and LM head are the target's (shared by the proposer after load),
so the draft allocates neither. Written against vLLM 0.32.0.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix
from vllm.transformers_utils.config import set_default_rope_theta

from vllm_dflash import ops
from vllm_dflash.serving import context_precision

logger = logging.getLogger("vllm.vllm_dflash")  # under vLLM's logger, so its handler prints it

# (fused parameter, checkpoint name part it holds, shard id), as in vLLM's Qwen models.
STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# Tensors a z-lab draft may ship but never uses here: embedding and LM head are the target's.
SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.")

# vLLM attention backend name -> KV cache layout understood by ops.write_context_kv.
CACHE_LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "flash"}


def _draft_hf_config(vllm_config: VllmConfig):
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise ValueError("the DFlash draft model needs speculative_config with a draft model")
    return spec.draft_model_config.hf_config


def _check_full_attention(config) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    dflash = getattr(config, "dflash_config", None) or {}
    if any(t != "full_attention" for t in layer_types) or dflash.get("use_swa"):
        raise ValueError(
            f"draft layer_types={list(layer_types)} / dflash_config.use_swa="
            f"{dflash.get('use_swa')} ask for sliding-window attention, which vllm-dflash "
            "does not serve; use a draft with full attention in every layer, or run vLLM's "
            "in-tree DFlash with VLLM_DFLASH_IMPL=vllm"
        )


def _rope_keys(rope: nn.Module, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """RoPE on keys with the platform's kernel. This path runs outside the
    compiled graph, where vLLM's CustomOp dispatch (custom ops off under
    torch.compile) would pick the slow native version."""
    if keys.device.type == "cuda" and hasattr(rope, "forward_cuda"):
        return rope.forward_cuda(positions, keys, None)[0]
    if keys.device.type == "cpu" and hasattr(rope, "forward_cpu"):
        return rope.forward_cpu(positions, keys, None)[0]
    return rope.forward_native(positions, keys, None)[0]


def _is_table_rope(rope: nn.Module) -> bool:
    """True for vLLM's RotaryEmbedding and the subclasses that only change its
    cos_sin_cache (Llama3, YaRN, linear/NTK scaling): their rotation is a
    plain cos_sin_cache lookup, which ops.context_kv_write does itself."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    cls = type(rope)
    methods = ("forward", "forward_native", "forward_static", "forward_cpu", "forward_cuda")
    return isinstance(rope, RotaryEmbedding) and all(getattr(cls, m) is getattr(RotaryEmbedding, m) for m in methods)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose K/V for context tokens come from target features."""

    def __init__(self, config, cache_config, quant_config, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _norm_heads(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.view(*x.shape[:-1], -1, self.head_dim)).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Attention of the query block; vLLM writes the block's K/V at its slots."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self._norm_heads(self.q_norm, q)
        k = self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out

    def project_context_kv(self, context: torch.Tensor) -> torch.Tensor:
        """[n, 2 * kv_size] K/V projection of context features through this
        layer's own qkv_proj (used for quantized drafts, whose packed weights
        cannot be sliced into DFlashModel.context_kv_proj)."""
        return self.qkv_proj(context)[0][:, self.q_size :]

    def cache_layout(self) -> str | None:
        """ops.write_context_kv layout of this layer's cache; None for other backends."""
        return CACHE_LAYOUTS.get(self.attn.get_attn_backend().get_name())

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V at `slot_mapping` (-1 = skip) in this layer's paged cache."""
        layout = self.cache_layout()
        if layout is not None:
            ops.write_context_kv(key, value, self.attn.kv_cache, slot_mapping, layout)
            return
        # Any other backend: its own cache writer (it skips negative slots).
        self.attn.impl.do_kv_cache_update(self.attn, key, value, self.attn.kv_cache, slot_mapping)


class DFlashMLP(nn.Module):
    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"draft hidden_act={config.hidden_act!r} is not supported; DFlash drafts use 'silu'"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(x))
        return x


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, cache_config, quant_config, prefix: str):
        super().__init__()
        self.self_attn = DFlashAttention(config, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = DFlashMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class DFlashModel(nn.Module):
    """fc + hidden_norm (context features), decoder layers, final norm.

    `embed_tokens` is set to the target's embedding by the proposer. vLLM
    compiles `forward` (the query-block pass) unless enforce_eager; the
    context-K/V path runs eagerly, its shapes change every step."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        config = _draft_hf_config(vllm_config)
        _check_full_attention(config)
        set_default_rope_theta(config, default_theta=1000000)
        cache_config = get_current_vllm_config().cache_config
        quant_config = get_draft_quant_config(vllm_config)

        dflash = getattr(config, "dflash_config", None) or {}
        num_features = len(dflash.get("target_layer_ids") or ())
        if num_features == 0:
            raise ValueError(
                "draft dflash_config.target_layer_ids is empty; list the 0-based target "
                "layers whose hidden states the draft was trained on"
            )
        target_hidden = getattr(config, "target_hidden_size", None) or vllm_config.model_config.get_hidden_size()
        self.fc = ReplicatedLinear(
            num_features * target_hidden,
            config.hidden_size,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.fc",
            return_bias=False,
        )
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Layers are named after the target's so their attention layer names
        # (and KV cache entries) never collide with the target's.
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, cache_config, quant_config, f"{prefix}.layers.{start_layer_id + i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.embed_tokens: nn.Module | None = None
        # K/V projections of all layers for context tokens, as one GEMM. Filled
        # from each layer's (TP-local) qkv_proj at load; vLLM then gives it the
        # platform's GEMM like any linear layer. Packed quantized weights can't
        # be sliced: quantized drafts project per layer instead.
        attn = self.layers[0].self_attn
        self.k_norm_weight = torch.stack([layer.self_attn.k_norm.weight.data for layer in self.layers])
        self.context_kv_proj = None
        if quant_config is None:
            self.context_kv_proj = ReplicatedLinear(
                config.hidden_size,
                len(self.layers) * 2 * attn.kv_size,
                bias=getattr(config, "attention_bias", False),
                quant_config=None,
                prefix=f"{prefix}.context_kv_proj",
                return_bias=False,
            )
        self._fp32_weights: tuple | None = None  # decided at the first context write

    def project_context_kv(self, target_features: torch.Tensor) -> torch.Tensor:
        """Raw K/V (before k_norm and RoPE) of context tokens in every layer,
        [n, L, 2, H_kv, d]: fc + hidden_norm, then one K/V projection (in
        float32 where that is faster here: `serving.context_precision`)."""
        attn = self.layers[0].self_attn
        shape = (target_features.shape[0], len(self.layers), 2, attn.num_kv_heads, attn.head_dim)
        if self._fp32_weights is None:
            self._fp32_weights = self._choose_context_precision(target_features)
        if self._fp32_weights:
            return context_precision.project_fp32(target_features, *self._fp32_weights).to(
                target_features.dtype).view(shape)
        return self._project_context_kv_native(target_features).view(shape)

    def _choose_context_precision(self, target_features: torch.Tensor) -> tuple:
        """() for the model's own dtype, else the float32 weights of project_fp32."""
        norm, kv_proj = self.hidden_norm, self.context_kv_proj
        plain = (kv_proj is not None and norm.has_weight and norm.variance_size_override is None
                 and isinstance(getattr(self.fc, "weight", None), torch.Tensor)
                 and isinstance(getattr(kv_proj, "weight", None), torch.Tensor))
        if target_features.device.type != "cpu" or target_features.dtype == torch.float32 or not plain:
            return ()
        bias = getattr(kv_proj, "bias", None)
        weights = (self.fc.weight.detach().float(), norm.weight.detach().float(), norm.variance_epsilon,
                   kv_proj.weight.detach().float(), None if bias is None else bias.detach().float())
        sample = target_features[:64]
        if sample.shape[0] < 16:  # decide on a batch that stands for a step, not on one token
            sample = sample.repeat((16 + sample.shape[0] - 1) // sample.shape[0], 1)[:16]
        choice = context_precision.choose_faster({
            "native": lambda: self._project_context_kv_native(sample),
            "float32": lambda: context_precision.project_fp32(sample, *weights).to(sample.dtype),
        })
        logger.info("vllm-dflash: context K/V projection in %s (measured faster than %s here)",
                    choice if choice == "float32" else str(target_features.dtype),
                    str(target_features.dtype) if choice == "float32" else "float32")
        return weights if choice == "float32" else ()

    def _project_context_kv_native(self, target_features: torch.Tensor) -> torch.Tensor:
        context = self.fc(target_features)
        norm = self.hidden_norm
        if norm.has_weight and norm.variance_size_override is None and norm.weight.dtype == context.dtype:
            # vLLM's RMSNorm math in one native call (the module dispatches ~8
            # torch ops here, outside any compiled graph).
            context = ops.rms_norm(context, norm.weight, norm.variance_epsilon)
        else:
            context = norm(context)
        if self.context_kv_proj is not None:
            return self.context_kv_proj(context)
        return torch.stack([layer.self_attn.project_context_kv(context) for layer in self.layers], dim=1)

    def norm_rope_context_kv(
        self, kv: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of context tokens in every layer, [n, L, H_kv, d]
        each, from `project_context_kv`'s output: k_norm with the layers'
        stacked weights, RoPE at the tokens' positions, in torch (the fused
        native version is ops.context_kv_write)."""
        attn = self.layers[0].self_attn
        n, num_layers = kv.shape[0], kv.shape[1]
        k, v = kv[:, :, 0], kv[:, :, 1]
        # k_norm of every layer in one pass (same arithmetic as vLLM's RMSNorm).
        k32 = k.float()
        k32 = k32 * torch.rsqrt(k32.pow(2).mean(dim=-1, keepdim=True) + attn.k_norm.variance_epsilon)
        k = (k32.to(self.k_norm_weight.dtype) * self.k_norm_weight[:, None, :]).to(kv.dtype)
        # All layers share one RoPE: rotate L * H_kv heads per token in one call.
        k = _rope_keys(attn.rotary_emb, positions, k.reshape(n, -1).contiguous())
        return k.view(n, num_layers, attn.num_kv_heads, attn.head_dim), v

    def context_kv(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of context tokens in every layer, [n, L, H_kv, d] each."""
        return self.norm_rope_context_kv(self.project_context_kv(target_features), positions)

    def fused_context_kv_layout(self, kv_caches: list[torch.Tensor], dtype: torch.dtype) -> str | None:
        """The cache layout when ops.context_kv_write can do k_norm + RoPE +
        store of all layers in one call (same backend and cache spec in every
        layer, table RoPE, unquantized cache in the model dtype), else None."""
        attns = [layer.self_attn for layer in self.layers]
        layouts = {a.cache_layout() for a in attns}
        if len(layouts) != 1 or None in layouts or not _is_table_rope(attns[0].rotary_emb):
            return None
        first = kv_caches[0]
        if first.dim() != 4 or self.k_norm_weight.dtype != dtype:
            return None
        if any(c.dtype != dtype or c.shape != first.shape or c.stride() != first.stride() for c in kv_caches):
            return None
        return layouts.pop()

    def finish_loading(self) -> None:
        """After the checkpoint is loaded: fill context_kv_proj with every
        layer's K/V rows of qkv_proj and stack the layers' k_norm weights."""
        attns = [layer.self_attn for layer in self.layers]
        self.k_norm_weight = torch.stack([a.k_norm.weight.data for a in attns])  # [L, d]
        if self.context_kv_proj is None:
            return
        self.context_kv_proj.weight.data.copy_(
            torch.cat([a.qkv_proj.weight.data[a.q_size :] for a in attns])
        )
        if self.context_kv_proj.bias is not None:
            self.context_kv_proj.bias.data.copy_(
                torch.cat([a.qkv_proj.bias.data[a.q_size :] for a in attns])
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DFlashDraftForCausalLM(nn.Module):
    """vLLM model class for `architectures: ["DFlashDraftModel"]` checkpoints."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config = _draft_hf_config(vllm_config)
        self.start_layer_id = vllm_config.model_config.get_total_num_hidden_layers()
        self.model = DFlashModel(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), start_layer_id=self.start_layer_id
        )
        self.lm_head: nn.Module | None = None  # the target's, set by the proposer
        # (first layer's cache, dtype, ops.context_kv_write arguments or None):
        # see _fused_context_kv.
        self._fused_plan: tuple | None = None
        self.logits_processor = LogitsProcessor(self.config.vocab_size, scale=getattr(self.config, "logit_scale", 1.0))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def attention_layers(self) -> list[DFlashAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def store_context_kv(
        self,
        target_features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor | None,
    ) -> None:
        """Compute context K/V of `target_features` ([n, L*D], the concatenated
        target hidden states of n tokens) at `positions` and write them into
        every draft layer's cache at `slot_mapping` (-1 skips a row; None only
        computes, for memory profiling).

        Per step this is four native calls: the fc GEMM, ops.rms_norm
        (hidden_norm), the K/V GEMM of all layers, then ops.context_kv_write
        for k_norm, RoPE and the cache stores of all layers. Backends or RoPE
        variants the fused op does not cover take the torch path
        (`norm_rope_context_kv` + per-layer `write_kv`)."""
        model = self.model
        kv = model.project_context_kv(target_features)
        if slot_mapping is not None:
            fused = self._fused_context_kv(kv)
            if fused is not None:
                caches, layout, eps, cos_sin_cache, is_neox = fused
                key, value = kv.unbind(2)
                ops.context_kv_write(
                    key, value, model.k_norm_weight, eps, cos_sin_cache, positions, is_neox, caches, slot_mapping,
                    layout,
                )  # fmt: skip
                return
        keys, values = model.norm_rope_context_kv(kv, positions)
        if slot_mapping is None:
            return
        for i, attn in enumerate(self.attention_layers()):
            attn.write_kv(keys[:, i], values[:, i], slot_mapping)

    def _fused_context_kv(self, kv: torch.Tensor) -> tuple | None:
        """(caches, layout, k_norm eps, cos_sin_cache, neox) for
        ops.context_kv_write, or None for the unfused path. Decided once (the
        cos/sin table is a constant), again when vLLM re-binds the caches."""
        first = self.model.layers[0].self_attn
        plan = self._fused_plan
        if plan is None or plan[0] is not first.attn.kv_cache or plan[1] != kv.dtype:
            caches = [a.attn.kv_cache for a in self.attention_layers()]
            layout = self.model.fused_context_kv_layout(caches, kv.dtype)
            args = None
            if layout is not None:
                rope = first.rotary_emb
                cos_sin_cache = rope.cos_sin_cache.to(device=kv.device, dtype=kv.dtype)
                args = (caches, layout, first.k_norm.variance_epsilon, cos_sin_cache, rope.is_neox_style)
            plan = self._fused_plan = (caches[0], kv.dtype, args)
        return plan[2]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load z-lab names (`fc.weight`, `layers.N.self_attn.q_proj.weight`, ...)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("model.")
            if name.startswith(SHARED_WITH_TARGET):
                continue
            name = "model." + name
            for param_part, ckpt_part, shard_id in STACKED_PARAMS:
                if ckpt_part in name:
                    name = name.replace(ckpt_part, param_part)
                    break
            else:
                shard_id = None
            if name not in params:
                raise ValueError(
                    f"DFlash checkpoint tensor {ckpt_name!r} has no place in the draft "
                    f"(num_hidden_layers={self.config.num_hidden_layers}); expected z-lab "
                    "names: fc, hidden_norm, norm, layers.N.{self_attn,mlp,input_layernorm,"
                    "post_attention_layernorm}.*"
                )
            param = params[name]
            if shard_id is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
            loaded.add(name)
        self.model.finish_loading()
        derived = {n for n in params if n.startswith("model.context_kv_proj.")}
        loaded |= derived
        missing = set(params) - loaded
        if missing:
            raise ValueError(
                f"DFlash checkpoint lacks {sorted(missing)}; a z-lab draft ships fc, "
                "hidden_norm, norm and every layer's attention, MLP and norms"
            )
        return loaded
