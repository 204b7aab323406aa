"""Architecture of the toy target: a plain transformers Qwen3ForCausalLM.

Defaults give about 8.4M parameters with an 8192 vocabulary (embeddings tied to the
LM head), head_dim 64 (one vLLM's CPU attention supports), and 8 layers so DFlash
can tap several distinct target layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import Qwen3Config, Qwen3ForCausalLM

from vllm_dflash.zoo import IM_END_ID, ENDOFTEXT_ID, PAD_TOKEN_ID

SUPPORTED_HEAD_DIMS = (64, 128)   # vLLM CPU attention


@dataclass
class TargetShape:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048

    def validate(self, smoke: bool = False) -> None:
        if not smoke and self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim}: vLLM's CPU attention needs one of {SUPPORTED_HEAD_DIMS}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not smoke and self.num_hidden_layers < 6:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: use at least 6 so DFlash can "
                             "read several distinct target layers")


def make_config(shape: TargetShape) -> Qwen3Config:
    return Qwen3Config(
        **asdict(shape),
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
        bos_token_id=None, eos_token_id=IM_END_ID, pad_token_id=PAD_TOKEN_ID,
        architectures=["Qwen3ForCausalLM"])


def make_model(shape: TargetShape) -> Qwen3ForCausalLM:
    config = make_config(shape)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def count_parameters(model) -> int:
    """Unique parameters (the tied LM head counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


GENERATION_EOS = [IM_END_ID, ENDOFTEXT_ID]
