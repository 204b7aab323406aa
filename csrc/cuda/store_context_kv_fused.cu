// CUDA store_context_kv_fused for the FlashAttention cache layout: one thread block
// per (token, layer), one warp per KV head. Per head: fp32 sum of squares
// (warp reduction), RMSNorm rounded to the model dtype, times the k_norm
// weight (rounded), RoPE in fp32 without FMA contraction (rounded once), then
// K and V stored at the token's slot. Same arithmetic as the CPU kernel and
// ops.rms_norm_rope_ref up to the order of the sum of squares.
// Bounds checks stay on in release builds (device-side assert).
#undef NDEBUG
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cassert>
#include <cstdio>

#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

constexpr int kLayersPerLaunch = 16;
constexpr int kWarps = 4;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

struct LayerCaches {
  void* ptr[kLayersPerLaunch];
};

template <typename scalar_t, typename cos_t>
__global__ void store_context_kv_fused_kernel(StoreContextKVFusedArgs a, LayerCaches caches,
                                        int64_t layer0) {
  const int64_t i = blockIdx.x;
  const int64_t l = layer0 + blockIdx.y;
  const int64_t slot = a.slot_mapping[i];
  if (slot < 0) return;
  const int64_t pos = a.positions[i];
  const int64_t capacity = a.num_blocks * a.block_size;
  if (slot >= capacity || pos < 0 || pos >= a.max_pos) {
    if (threadIdx.x == 0) {
      printf("vllm_dflash.store_context_kv_fused: row %lld has slot %lld (cache: %lld "
             "slots) and position %lld (cos_sin_cache: %lld positions)\n",
             static_cast<long long>(i), static_cast<long long>(slot),
             static_cast<long long>(capacity), static_cast<long long>(pos),
             static_cast<long long>(a.max_pos));
    }
    assert(slot < capacity && pos >= 0 && pos < a.max_pos &&
           "vllm_dflash.store_context_kv_fused: slot or position out of range");
    return;
  }
  const int64_t b = slot / a.block_size, o = slot % a.block_size;
  const int64_t d = a.head_size, half = a.rot_dim / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const scalar_t* key = static_cast<const scalar_t*>(a.key) + i * a.key_stride[0] +
                        l * a.key_stride[1];
  const scalar_t* value = static_cast<const scalar_t*>(a.value) +
                          i * a.value_stride[0] + l * a.value_stride[1];
  const scalar_t* w = static_cast<const scalar_t*>(a.k_norm_weight) + l * a.weight_stride[0];
  const cos_t* cos = static_cast<const cos_t*>(a.cos_sin_cache) + pos * a.cos_sin_stride[0];
  const cos_t* sin = cos + half * a.cos_sin_stride[1];
  scalar_t* block = static_cast<scalar_t*>(caches.ptr[blockIdx.y]) + b * a.cache_block_stride +
                    o * a.cache_token_stride;

  for (int64_t h = warp; h < a.num_heads; h += kWarps) {
    const scalar_t* kh = key + h * a.key_stride[2];
    const scalar_t* vh = value + h * a.value_stride[2];
    scalar_t* dst = block + h * a.cache_head_stride;  // K at [0, d), V at [d, 2d)
    float ss = 0.f;
    for (int64_t j = lane; j < d; j += 32) {
      const float x = to_float(kh[j]);
      ss = __fadd_rn(ss, __fmul_rn(x, x));
    }
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float inv = 1.f / sqrtf(ss / static_cast<float>(d) + a.eps);
    auto normed = [&](int64_t j) {
      const float n = round_to<scalar_t>(__fmul_rn(to_float(kh[j]), inv));
      return round_to<scalar_t>(__fmul_rn(n, to_float(w[j * a.weight_stride[1]])));
    };
    for (int64_t j = lane; j < half; j += 32) {
      const int64_t p = a.is_neox ? j : 2 * j, q = a.is_neox ? j + half : 2 * j + 1;
      const float c = to_float(cos[j * a.cos_sin_stride[1]]);
      const float s = to_float(sin[j * a.cos_sin_stride[1]]);
      const float x1 = normed(p), x2 = normed(q);
      dst[p] = from_float<scalar_t>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      dst[q] = from_float<scalar_t>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
    for (int64_t j = a.rot_dim + lane; j < d; j += 32) dst[j] = from_float<scalar_t>(normed(j));
    for (int64_t j = lane; j < d; j += 32) dst[d + j] = vh[j];
  }
}

template <typename scalar_t, typename cos_t>
cudaError_t launch_typed(const StoreContextKVFusedArgs& a, cudaStream_t stream) {
  for (int64_t layer0 = 0; layer0 < a.num_layers; layer0 += kLayersPerLaunch) {
    const int64_t count = std::min<int64_t>(kLayersPerLaunch, a.num_layers - layer0);
    LayerCaches caches{};
    for (int64_t l = 0; l < count; ++l) caches.ptr[l] = a.caches[layer0 + l];
    const dim3 grid(static_cast<unsigned int>(a.n), static_cast<unsigned int>(count));
    store_context_kv_fused_kernel<scalar_t, cos_t><<<grid, 32 * kWarps, 0, stream>>>(a, caches, layer0);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename scalar_t>
cudaError_t dispatch_cos_sin(const StoreContextKVFusedArgs& a, cudaStream_t stream) {
  switch (a.cos_sin_dtype) {
    case 0: return launch_typed<scalar_t, float>(a, stream);
    case 1: return launch_typed<scalar_t, __half>(a, stream);
    default: return launch_typed<scalar_t, __nv_bfloat16>(a, stream);
  }
}

}  // namespace

cudaError_t launch_store_context_kv_fused(const StoreContextKVFusedArgs& args,
                                    cudaStream_t stream) {
  if (args.n == 0 || args.num_layers == 0 || args.num_heads == 0 || args.head_size == 0)
    return cudaSuccess;
  switch (args.dtype) {
    case 0: return dispatch_cos_sin<float>(args, stream);
    case 1: return dispatch_cos_sin<__half>(args, stream);
    default: return dispatch_cos_sin<__nv_bfloat16>(args, stream);
  }
}

}  // namespace vllm_dflash::cuda
