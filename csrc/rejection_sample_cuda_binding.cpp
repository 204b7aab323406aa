// ==== CUDA binding of torch.ops.vllm_dflash.rejection_sample ====
// Compiles to nothing unless VLLM_DFLASH_WITH_CUDA is defined (CMakeLists.txt
// defines it with -DVLLM_DFLASH_CUDA=ON): it needs torch's c10/cuda headers and
// csrc/cuda/rejection_sample.cu. The op schema and the argument checks live in
// csrc/cpu/rejection_sample.cpp, which every build compiles.
#ifdef VLLM_DFLASH_WITH_CUDA

#include "rejection_sample.h"

#include "cuda/rejection_sample.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

namespace vllm_dflash {
namespace {

template <typename T>
const T* optional_ptr(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<T>() : nullptr;
}

at::Tensor rejection_sample_cuda(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len) {
  const c10::cuda::OptionalCUDAGuard guard(target_probs.device());
  at::Tensor out = check_rejection_sample_args(
      draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs,
      bonus_token_ids, is_greedy, uniforms, exp_noise, max_spec_len);
  const cudaError_t err = launch_rejection_sample(
      out.data_ptr<int32_t>(), draft_token_ids.data_ptr<int32_t>(),
      cu_num_draft_tokens.data_ptr<int32_t>(), target_probs.data_ptr<float>(),
      optional_ptr<float>(draft_probs), optional_ptr<int32_t>(bonus_token_ids),
      optional_ptr<bool>(is_greedy), optional_ptr<double>(uniforms),
      optional_ptr<float>(exp_noise), cu_num_draft_tokens.size(0),
      target_probs.size(1), max_spec_len,
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "rejection_sample: CUDA launch failed: ",
              cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace vllm_dflash

TORCH_LIBRARY_IMPL(vllm_dflash, CUDA, m) {
  m.impl("rejection_sample", &vllm_dflash::rejection_sample_cuda);
}

#endif  // VLLM_DFLASH_WITH_CUDA
