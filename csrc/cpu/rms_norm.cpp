// CPU RMSNorm over the last dim with the rounding of vLLM's native RMSNorm
// (vllm/ir/ops/layernorm.py) and transformers' Qwen3RMSNorm: fp32 sum of
// squares, x * (1 / sqrt(mean + eps)) rounded to the dtype, times the weight
// (rounded). One native call instead of ~8 small torch ops on the draft's
// eager context path.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#include "../ops_common.h"
#include "ops.h"

namespace vllm_dflash {
namespace {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows,
                   int64_t d, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * d;
      scalar_t* o = out + r * d;
      float ss = 0.f;
      for (int64_t j = 0; j < d; ++j) {
        const float v = static_cast<float>(xr[j]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (int64_t j = 0; j < d; ++j) {
        const float normed = static_cast<float>(static_cast<scalar_t>(static_cast<float>(xr[j]) * inv));
        o[j] = static_cast<scalar_t>(normed * static_cast<float>(w[j]));
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rms_norm_inputs(input, weight);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  if (rows == 0) return out;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_rows(x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                    out.data_ptr<float>(), rows, d, e);
      break;
    case at::kHalf:
      rms_norm_rows(x.const_data_ptr<c10::Half>(), w.const_data_ptr<c10::Half>(),
                    out.data_ptr<c10::Half>(), rows, d, e);
      break;
    default:
      rms_norm_rows(x.const_data_ptr<c10::BFloat16>(), w.const_data_ptr<c10::BFloat16>(),
                    out.data_ptr<c10::BFloat16>(), rows, d, e);
  }
  return out;
}

}  // namespace vllm_dflash
