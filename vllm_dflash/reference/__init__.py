"""Reference DFlash: pure PyTorch + transformers draft model, z-lab checkpoint
I/O and the speculative decoding loop. The oracle for the serving path and the
model the training pipeline trains; it never imports vLLM.
"""

from vllm_dflash.reference.checkpoint import (
    load_draft,
    load_draft_config,
    new_draft_config,
    save_draft,
)
from vllm_dflash.reference.features import TargetFeatures, decoder_layers
from vllm_dflash.reference.model import ContextKVCache, DFlashDraftModel
from vllm_dflash.reference.spec_decode import SpecResult, spec_generate, target_greedy_generate

__all__ = [
    "ContextKVCache",
    "DFlashDraftModel",
    "SpecResult",
    "TargetFeatures",
    "decoder_layers",
    "load_draft",
    "load_draft_config",
    "new_draft_config",
    "save_draft",
    "spec_generate",
    "target_greedy_generate",
]
