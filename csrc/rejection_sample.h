// Argument checks of torch.ops.vllm_dflash.rejection_sample, shared by the CPU
// implementation (csrc/cpu/rejection_sample.cpp, which also defines the schema)
// and the CUDA binding (csrc/rejection_sample_cuda_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace vllm_dflash {

// Checks shapes, dtypes, devices and contiguity; returns the output tensor
// [batch, max_spec_len + 1] int32 (uninitialized: the kernels write every slot).
at::Tensor check_rejection_sample_args(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len);

}  // namespace vllm_dflash
