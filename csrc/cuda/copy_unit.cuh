// Widest copy unit (16/8/4/2/1 bytes) that divides every address and stride
// of a copy: row copies then move whole 128-bit words whenever the tensors
// allow it, and still work for odd views.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_dflash::cuda {

inline int copy_unit_bytes(uint64_t alignment_mask) {
  for (int unit = 16; unit > 1; unit /= 2) {
    if ((alignment_mask & static_cast<uint64_t>(unit - 1)) == 0) return unit;
  }
  return 1;
}

// Calls f(T{}) with the unsigned type of `unit_bytes` width.
template <typename F>
cudaError_t dispatch_copy_unit(int unit_bytes, F&& f) {
  switch (unit_bytes) {
    case 16: return f(uint4{});
    case 8: return f(uint2{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return f(uint8_t{});
  }
}

inline int threads_for(int64_t units) {
  const int64_t warps = (units + 31) / 32;
  return static_cast<int>(warps >= 8 ? 256 : (warps < 1 ? 32 : warps * 32));
}

}  // namespace vllm_dflash::cuda
