"""DFlash draft model on vLLM's layers, paged KV cache and weight loading.

A z-lab DFlash draft is a stack of Qwen3 decoder layers with two twists:

* Context K/V come from the *target's* hidden states (several target layers
  concatenated, projected by `fc`, normed by `hidden_norm`), not from draft
  tokens. `store_context_kv` (serving.context_kv) computes them for newly verified tokens only and
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

from vllm_dflash.config import DFlashConfig
from vllm_dflash.serving.context_kv import ContextKVWriter
from vllm_dflash.serving.draft_resolution import dflash_config_of

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

def _draft_hf_config(vllm_config: VllmConfig):
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        raise ValueError("the DFlash draft model needs speculative_config with a draft model")
    return spec.draft_model_config.hf_config


def _check_full_attention(config, dflash: DFlashConfig) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or dflash.use_swa:
        raise ValueError(
            f"draft layer_types={list(layer_types)} / dflash_config.use_swa="
            f"{dflash.use_swa} ask for sliding-window attention, which vllm-dflash "
            "does not serve; use a draft with full attention in every layer, or run vLLM's "
            "in-tree DFlash with VLLM_DFLASH_IMPL=vllm"
        )


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
        dflash = dflash_config_of(vllm_config.speculative_config)
        _check_full_attention(config, dflash)
        set_default_rope_theta(config, default_theta=1000000)
        cache_config = get_current_vllm_config().cache_config
        quant_config = get_draft_quant_config(vllm_config)

        target_hidden = getattr(config, "target_hidden_size", None) or vllm_config.model_config.get_hidden_size()
        self.fc = ReplicatedLinear(
            dflash.num_features * target_hidden,
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
        # from each layer's (TP-local) qkv_proj at load (with k_norm_weight:
        # serving.context_kv.ContextKVWriter.stack_weights); vLLM then gives it the
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
        self.context_kv_writer = ContextKVWriter(self.model)
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

    def store_context_kv(
        self,
        target_features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor | None,
    ) -> None:
        """Context K/V of `target_features` ([n, L*D], the concatenated target
        hidden states of n tokens) at `positions`, written into every draft
        layer's cache at `slot_mapping` (-1 skips a row; None only computes):
        serving.context_kv.ContextKVWriter.store."""
        self.context_kv_writer.store(target_features, positions, slot_mapping)

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
        self.context_kv_writer.stack_weights()
        derived = {n for n in params if n.startswith("model.context_kv_proj.")}
        loaded |= derived
        missing = set(params) - loaded
        if missing:
            raise ValueError(
                f"DFlash checkpoint lacks {sorted(missing)}; a z-lab draft ships fc, "
                "hidden_norm, norm and every layer's attention, MLP and norms"
            )
        return loaded
