"""gather_hidden_states: target hidden states of the captured layers -> the draft's fc input."""

from __future__ import annotations

import torch

from vllm_dflash.ops import dispatch, reference


def gather_hidden_states(
    hidden_states: list[torch.Tensor] | tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ``i`` of the result is ``cat([h[indices[i]] for h in hidden_states])``.

    hidden_states: L tensors ``[T, D]``, one dtype and device; row-strided views
    (e.g. slices of a larger buffer) are read in place. indices: int32/int64
    ``[n]`` in ``[0, T)``. Returns a contiguous ``[n, L*D]`` tensor, written into
    ``out`` when given (e.g. a persistent CUDA-graph buffer). An out-of-range
    index raises ValueError on CPU; on CUDA it traps the kernel with a printed
    message (no host sync on the hot path).
    """
    if not dispatch.use_native("gather_hidden_states", indices.device.type):
        return reference.gather_hidden_states_ref(hidden_states, indices, out)
    hidden_states = list(hidden_states)
    if out is None:
        return torch.ops.vllm_dflash.gather_hidden_states(hidden_states, indices)
    torch.ops.vllm_dflash.gather_hidden_states_out(hidden_states, indices, out)
    return out
