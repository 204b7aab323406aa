// CPU implementations of the vllm_dflash ops, all registered here (schemas:
// csrc/torch_bindings.cpp; kernels: csrc/cpu/*.cpp).
#include <torch/library.h>

#include "cpu/ops.h"

TORCH_LIBRARY_IMPL(vllm_dflash, CPU, m) {
  m.impl("gather_hidden_states", &vllm_dflash::gather_hidden_states_cpu);
  m.impl("gather_hidden_states_out", &vllm_dflash::gather_hidden_states_out_cpu);
  m.impl("store_context_kv_layer", &vllm_dflash::store_context_kv_layer_cpu);
  m.impl("store_context_kv_fused", &vllm_dflash::store_context_kv_fused_cpu);
  m.impl("rms_norm", &vllm_dflash::rms_norm_cpu);
  m.impl("logits_top2", &vllm_dflash::logits_top2_cpu);
  m.impl("prepare_dflash_inputs", &vllm_dflash::prepare_dflash_inputs_cpu);
  m.impl("rejection_sample", &vllm_dflash::rejection_sample_cpu);
}
