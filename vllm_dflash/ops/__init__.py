"""Native ops of vllm-dflash (``torch.ops.vllm_dflash.*``), one module per op family.

On the DFlash hot path every step:

- ``prepare_dflash_inputs`` (step_inputs): the runner's batch -> context
  rows/positions/slots and the query block's ids, positions, slots, lengths;
- ``gather_hidden_states`` (hidden_states): target hidden states of the
  captured layers -> the draft's ``fc`` input ``[n, L*D]``;
- ``rms_norm`` (norm): the draft's ``hidden_norm`` of the context features;
- ``logits_top2`` (logits): the draft tokens (argmax) and their top-1/top-2
  logit margins, the adaptive controller's confidence;
- ``store_context_kv_fused`` (context_kv): projected context K/V of every
  draft layer -> k_norm, RoPE and vLLM's paged KV caches in one pass;
  ``store_context_kv_layer``: finished K/V -> one layer's cache, in the
  physical layout of the attention backend that reads it (kv_layout);
- ``rejection_sample`` (rejection): the verifier's accept / recover step.

`native` loads the library and registers the ops' fake implementations;
`dispatch` is the one policy deciding native kernel or pure-torch reference
for all seven (VLLM_DFLASH_NATIVE_OPS=0 picks the references); `reference`
holds the references, the specification the kernels match. Nothing here
imports vLLM.
"""

from vllm_dflash.ops import dispatch, reference
from vllm_dflash.ops.context_kv import store_context_kv_fused, store_context_kv_layer
from vllm_dflash.ops.hidden_states import gather_hidden_states
from vllm_dflash.ops.kv_layout import KV_LAYOUTS, resolve_kv_layout
from vllm_dflash.ops.native import HAS_NATIVE
from vllm_dflash.ops.logits import logits_argmax, logits_top2
from vllm_dflash.ops.norm import rms_norm
from vllm_dflash.ops.reference import DFlashStepInputs
from vllm_dflash.ops.rejection import rejection_sample
from vllm_dflash.ops.step_inputs import prepare_dflash_inputs

__all__ = [
    "HAS_NATIVE",
    "KV_LAYOUTS",
    "DFlashStepInputs",
    "dispatch",
    "gather_hidden_states",
    "logits_argmax",
    "logits_top2",
    "prepare_dflash_inputs",
    "reference",
    "rejection_sample",
    "resolve_kv_layout",
    "rms_norm",
    "store_context_kv_fused",
    "store_context_kv_layer",
]
