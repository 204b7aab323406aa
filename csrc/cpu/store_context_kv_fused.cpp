// CPU context K/V of every draft layer in one call: per (token, layer, head),
// RMSNorm of the raw key with the layer's k_norm weight, RoPE at the token's
// position, then K and V stored into the layer's paged cache (kv_layout.h).
//
// Arithmetic follows the pure-torch reference (ops.store_context_kv_fused_ref,
// itself vLLM's RMSNorm + rotary embedding): fp32 sum of squares and scaling,
// rounded to the model dtype, times the weight (rounded), then the rotation in
// fp32 with cos/sin read from the cache, rounded once. Only the order of the
// sum of squares differs from torch, so fp32 results agree to a few ulps and
// 16-bit results to one unit in the last place.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../ops_common.h"
#include "ops.h"
#include "kv_layout.h"

namespace vllm_dflash {
namespace {

template <typename scalar_t, typename cache_t>
void context_kv_kernel(const ContextKVShape& s, const at::Tensor& key,
                       const at::Tensor& value, const at::Tensor& k_norm_weight,
                       double eps, const at::Tensor& cos_sin_cache,
                       const int64_t* positions, bool is_neox,
                       at::TensorList kv_caches, const int64_t* slots) {
  using unit_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t, uint32_t>;
  const int64_t n = s.kv.n, L = s.num_layers, H = s.kv.num_heads,
                d = s.kv.head_size, N = s.kv.block_size, rot = s.rot_dim;
  const int64_t half = rot / 2;
  const scalar_t* k = key.const_data_ptr<scalar_t>();
  const scalar_t* v = value.const_data_ptr<scalar_t>();
  const scalar_t* w = k_norm_weight.const_data_ptr<scalar_t>();
  const cache_t* cs = cos_sin_cache.const_data_ptr<cache_t>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  const int64_t ws0 = k_norm_weight.stride(0), ws1 = k_norm_weight.stride(1);
  const int64_t css0 = cos_sin_cache.stride(0), css1 = cos_sin_cache.stride(1);
  std::vector<unit_t*> caches(L);
  for (int64_t l = 0; l < L; ++l) caches[l] = static_cast<unit_t*>(kv_caches[l].data_ptr());
  const int64_t cs0 = kv_caches[0].stride(0), cs1 = kv_caches[0].stride(1),
                cs2 = kv_caches[0].stride(2);
  const KVLayout layout = s.kv.layout;
  const float epsf = static_cast<float>(eps);

  // One task per (token, layer); ~16K elements per chunk keeps a decode step
  // (a few tokens) on one thread, where OpenMP's wake-up would cost more.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H * d, 1));
  at::parallel_for(0, n * L, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(d);
    std::vector<scalar_t> out(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / L, l = task % L;
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t b = slot / N, o = slot % N;
      const int64_t pos = positions[i];
      const cache_t* cos = cs + pos * css0;
      const cache_t* sin = cos + half * css1;
      const scalar_t* wl = w + l * ws0;
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* kh = k + i * ks0 + l * ks1 + h * ks2;
        float ss = 0.f;
        for (int64_t j = 0; j < d; ++j) {
          xf[j] = static_cast<float>(kh[j]);
          ss += xf[j] * xf[j];
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + epsf);
        // normed = round(round(x * inv) * w): RMSNorm in the model dtype.
        for (int64_t j = 0; j < d; ++j) {
          const float normed = static_cast<float>(static_cast<scalar_t>(xf[j] * inv));
          xf[j] = static_cast<float>(static_cast<scalar_t>(normed * static_cast<float>(wl[j * ws1])));
        }
        for (int64_t j = 0; j < half; ++j) {
          const float c = static_cast<float>(cos[j * css1]);
          const float sn = static_cast<float>(sin[j * css1]);
          const int64_t a = is_neox ? j : 2 * j, bi = is_neox ? j + half : 2 * j + 1;
          const float x1 = xf[a], x2 = xf[bi];
          out[a] = static_cast<scalar_t>(x1 * c - x2 * sn);
          out[bi] = static_cast<scalar_t>(x2 * c + x1 * sn);
        }
        for (int64_t j = rot; j < d; ++j) out[j] = static_cast<scalar_t>(xf[j]);
        store_kv_head(layout, caches[l] + b * cs0 + h * cs1, o, N, d, cs2,
                      reinterpret_cast<const unit_t*>(out.data()),
                      reinterpret_cast<const unit_t*>(v + i * vs0 + l * vs1 + h * vs2));
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache_dtype(const ContextKVShape& s, const at::Tensor& key,
                          const at::Tensor& value, const at::Tensor& w,
                          double eps, const at::Tensor& cos_sin_cache,
                          const int64_t* positions, bool is_neox,
                          at::TensorList kv_caches, const int64_t* slots) {
  switch (cos_sin_cache.scalar_type()) {
    case at::kFloat:
      return context_kv_kernel<scalar_t, float>(s, key, value, w, eps, cos_sin_cache,
                                                positions, is_neox, kv_caches, slots);
    case at::kHalf:
      return context_kv_kernel<scalar_t, c10::Half>(s, key, value, w, eps, cos_sin_cache,
                                                    positions, is_neox, kv_caches, slots);
    default:
      return context_kv_kernel<scalar_t, c10::BFloat16>(
          s, key, value, w, eps, cos_sin_cache, positions, is_neox, kv_caches, slots);
  }
}

}  // namespace

void store_context_kv_fused_cpu(const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& k_norm_weight, double eps,
                          const at::Tensor& cos_sin_cache,
                          const at::Tensor& positions, bool is_neox,
                          at::TensorList kv_caches, const at::Tensor& slot_mapping,
                          c10::string_view layout) {
  const ContextKVShape s = check_store_context_kv_fused_inputs(
      key, value, k_norm_weight, cos_sin_cache, positions, kv_caches,
      slot_mapping, layout);
  const at::Tensor slots = slot_mapping.contiguous();
  const at::Tensor pos = positions.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t capacity = s.kv.num_blocks * s.kv.block_size;
  for (int64_t i = 0; i < s.kv.n; ++i) {
    TORCH_CHECK_VALUE(sp[i] < capacity, "store_context_kv_fused: slot_mapping[", i,
                      "] = ", sp[i], " is outside the cache (", s.kv.num_blocks,
                      " blocks x ", s.kv.block_size, " = ", capacity, " slots)");
    TORCH_CHECK_VALUE(sp[i] < 0 || (pp[i] >= 0 && pp[i] < s.max_pos),
                      "store_context_kv_fused: positions[", i, "] = ", pp[i],
                      " is outside cos_sin_cache (", s.max_pos, " positions)");
  }
  if (s.kv.n == 0 || s.kv.head_size == 0) return;
  // Only the head dim has to be dense; token/layer/head strides are free.
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  switch (key.scalar_type()) {
    case at::kFloat:
      return dispatch_cache_dtype<float>(s, k, v, k_norm_weight, eps, cos_sin_cache,
                                         pp, is_neox, kv_caches, sp);
    case at::kHalf:
      return dispatch_cache_dtype<c10::Half>(s, k, v, k_norm_weight, eps, cos_sin_cache,
                                             pp, is_neox, kv_caches, sp);
    case at::kBFloat16:
      return dispatch_cache_dtype<c10::BFloat16>(s, k, v, k_norm_weight, eps,
                                                 cos_sin_cache, pp, is_neox,
                                                 kv_caches, sp);
    default:
      TORCH_CHECK_VALUE(false, "store_context_kv_fused: unsupported dtype ",
                        key.scalar_type(), "; use float32, float16 or bfloat16");
  }
}

}  // namespace vllm_dflash
