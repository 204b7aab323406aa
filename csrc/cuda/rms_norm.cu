// CUDA RMSNorm over the last dim, one thread block per row, with the rounding
// of vLLM's native RMSNorm (see csrc/cpu/rms_norm.cpp): fp32 statistics, no
// FMA contraction, x * inv rounded to the dtype, times the weight (rounded).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_f(float x) { return x; }
__device__ __forceinline__ float load_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float load_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  T t;
  store_f(&t, x);
  return load_f(t);
}

template <typename T>
__global__ void rms_norm_kernel(const T* x, const T* w, T* out, int64_t d, float eps) {
  __shared__ float warp_sums[kThreads / 32];
  const T* xr = x + blockIdx.x * d;
  T* o = out + blockIdx.x * d;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float v = load_f(xr[j]);
    ss = __fadd_rn(ss, __fmul_rn(v, v));
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (threadIdx.x == 0) warp_sums[0] = ss;
  }
  __syncthreads();
  const float inv = 1.f / sqrtf(warp_sums[0] / static_cast<float>(d) + eps);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float normed = round_to<T>(__fmul_rn(load_f(xr[j]), inv));
    store_f(o + j, __fmul_rn(normed, load_f(w[j])));
  }
}

template <typename T>
cudaError_t launch_typed(const void* x, const void* w, void* out, int64_t rows, int64_t d,
                         float eps, cudaStream_t stream) {
  rms_norm_kernel<T><<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out), d, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(const void* x, const void* weight, void* out, int64_t rows,
                            int64_t d, float eps, int dtype, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_typed<float>(x, weight, out, rows, d, eps, stream);
    case 1: return launch_typed<__half>(x, weight, out, rows, d, eps, stream);
    default: return launch_typed<__nv_bfloat16>(x, weight, out, rows, d, eps, stream);
  }
}

}  // namespace vllm_dflash::cuda
