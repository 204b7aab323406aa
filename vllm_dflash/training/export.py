"""Export a trained drafter as a z-lab DFlash checkpoint (what vLLM and z-lab load).

The folder holds config.json + model.safetensors with the draft's own tensors
only; embedding and LM head stay with the target.
"""

from __future__ import annotations

import os

import torch

from vllm_dflash.reference.checkpoint import save_draft
from vllm_dflash.reference.model import DFlashDraftModel
from vllm_dflash.training.trainer import CHECKPOINT_NAME

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_draft(draft: DFlashDraftModel, path: str, dtype: str = "bf16") -> str:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype={dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    save_draft(draft, path, EXPORT_DTYPES[dtype])
    return path


def draft_from_checkpoint(run_dir: str) -> DFlashDraftModel:
    """The float32 draft of a training checkpoint (to export a run without training it further)."""
    from transformers import Qwen3Config

    path = os.path.join(run_dir, CHECKPOINT_NAME)
    if not os.path.exists(path):
        raise ValueError(f"{run_dir} has no {CHECKPOINT_NAME}; train first")
    state = torch.load(path, map_location="cpu", weights_only=False)
    draft = DFlashDraftModel(Qwen3Config.from_dict(state["draft_config"]))
    draft.load_state_dict(state["draft"])
    return draft.float().eval()
