"""Target hidden-state features for DFlash, read from a Hugging Face target.

Forward hooks on the chosen decoder layers, not `output_hidden_states`:
transformers replaces the last entry of `hidden_states` with the final-normed
output, while DFlash (and vLLM's aux-hidden-state capture) use the residual
stream after each layer, so layer id `num_layers - 1` would silently differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """Decoder layers of an HF causal LM (Qwen3ForCausalLM, LlamaForCausalLM, ...)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    return base.layers


class TargetFeatures:
    """Records the outputs of target layers `layer_ids` in every forward.

    Use as a context manager around target forwards; `pop()` returns the
    features of the latest forward concatenated in layer order, [b, n, L*D].
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]):
        layers = decoder_layers(target)
        for i in layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(
                    f"target layer id {i} is out of range; the target has {len(layers)} layers"
                )
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._recorder(i)) for i in self.layer_ids]

    def _recorder(self, layer_id: int):
        def hook(module, args, output):
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def pop(self) -> torch.Tensor:
        if len(self._outputs) != len(self.layer_ids):
            raise RuntimeError("no target forward ran since the last pop()")
        feats = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1)
        self._outputs.clear()
        return feats

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> TargetFeatures:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
