// CUDA gather of target hidden states into the DFlash fc input: one thread
// block per (output row, layer), copying the row in the widest aligned unit.
// Bounds checks stay on in release builds (device-side assert).
#undef NDEBUG
#include <cassert>
#include <cstdio>

#include "copy_unit.cuh"
#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

constexpr int kLayersPerLaunch = 16;

struct LayerPtrs {
  const char* src[kLayersPerLaunch];
  int64_t stride[kLayersPerLaunch];  // bytes between rows
};

template <typename unit_t, typename index_t>
__global__ void gather_rows_kernel(LayerPtrs layers, const index_t* indices,
                                   int64_t num_rows, int64_t units_per_row,
                                   int64_t out_units_per_row, int64_t layer0,
                                   unit_t* out) {
  const int64_t i = blockIdx.x;
  const int l = blockIdx.y;
  const int64_t r = static_cast<int64_t>(indices[i]);
  if (r < 0 || r >= num_rows) {
    if (threadIdx.x == 0) {
      printf("vllm_dflash.gather_hidden_states: indices[%lld] = %lld is out "
             "of range [0, %lld)\n",
             static_cast<long long>(i), static_cast<long long>(r),
             static_cast<long long>(num_rows));
    }
    assert(r >= 0 && r < num_rows && "vllm_dflash.gather_hidden_states: index out of range");
    return;
  }
  const unit_t* src =
      reinterpret_cast<const unit_t*>(layers.src[l] + r * layers.stride[l]);
  unit_t* dst = out + i * out_units_per_row + (layer0 + l) * units_per_row;
  for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) {
    dst[u] = src[u];
  }
}

}  // namespace

cudaError_t launch_gather_hidden_states(const void* const* srcs,
                                        const int64_t* src_row_stride_bytes,
                                        int64_t num_layers, const void* indices,
                                        bool indices_are_int64, int64_t n,
                                        int64_t num_rows, int64_t row_bytes,
                                        void* out, cudaStream_t stream) {
  if (n == 0 || num_layers == 0 || row_bytes == 0) return cudaSuccess;
  uint64_t mask = static_cast<uint64_t>(row_bytes) |
                  reinterpret_cast<uintptr_t>(out);
  for (int64_t l = 0; l < num_layers; ++l) {
    mask |= reinterpret_cast<uintptr_t>(srcs[l]) |
            static_cast<uint64_t>(src_row_stride_bytes[l]);
  }
  const int unit = copy_unit_bytes(mask);
  return dispatch_copy_unit(unit, [&](auto unit_tag) -> cudaError_t {
    using unit_t = decltype(unit_tag);
    const int64_t units_per_row = row_bytes / static_cast<int64_t>(sizeof(unit_t));
    const int threads = threads_for(units_per_row);
    for (int64_t layer0 = 0; layer0 < num_layers; layer0 += kLayersPerLaunch) {
      const int64_t chunk =
          num_layers - layer0 < kLayersPerLaunch ? num_layers - layer0 : kLayersPerLaunch;
      LayerPtrs ptrs{};
      for (int64_t l = 0; l < chunk; ++l) {
        ptrs.src[l] = static_cast<const char*>(srcs[layer0 + l]);
        ptrs.stride[l] = src_row_stride_bytes[layer0 + l];
      }
      const dim3 grid(static_cast<unsigned int>(n), static_cast<unsigned int>(chunk));
      unit_t* dst = static_cast<unit_t*>(out);
      if (indices_are_int64) {
        gather_rows_kernel<unit_t, int64_t><<<grid, threads, 0, stream>>>(
            ptrs, static_cast<const int64_t*>(indices), num_rows, units_per_row,
            units_per_row * num_layers, layer0, dst);
      } else {
        gather_rows_kernel<unit_t, int32_t><<<grid, threads, 0, stream>>>(
            ptrs, static_cast<const int32_t*>(indices), num_rows, units_per_row,
            units_per_row * num_layers, layer0, dst);
      }
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
}

}  // namespace vllm_dflash::cuda
