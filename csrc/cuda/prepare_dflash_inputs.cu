// CUDA prepare_dflash_inputs (padded context: no compaction, no host sync).
// Block r < B fills request r's context rows and query block; block B fills
// the padding rows past query_start_loc[B]. Semantics: see
// csrc/cpu/prepare_dflash_inputs.cpp and ops.prepare_dflash_inputs.
#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

__device__ __forceinline__ int64_t load_index(const void* p, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i]
                  : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

__global__ void prepare_dflash_inputs_kernel(PrepareInputsArgs a) {
  const int64_t r = blockIdx.x;
  const bool has_rej = a.num_rejected != nullptr;
  if (r == a.batch) {  // padding rows: never written
    for (int64_t i = a.query_start_loc[a.batch] + threadIdx.x; i < a.num_rows; i += blockDim.x) {
      a.context_rows[i] = i;
      a.context_positions[i] = a.target_positions[i];
      a.context_slots[i] = has_rej ? -1 : a.slot_mapping[i];
    }
    if (threadIdx.x == 0) a.query_start_loc_out[a.batch] = static_cast<int32_t>(a.batch * a.q_len);
    return;
  }
  const int64_t first = a.query_start_loc[r], end = a.query_start_loc[r + 1];
  const int64_t rej = has_rej ? load_index(a.num_rejected, a.num_rejected_int64, r) : 0;
  const int64_t verified_end = max(first, end - rej);
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) {
    a.context_rows[i] = i;
    a.context_positions[i] = a.target_positions[i];
    a.context_slots[i] = i < verified_end ? a.slot_mapping[i] : -1;
  }
  int64_t start = 0;
  if (verified_end > first) {
    start = a.target_positions[verified_end - 1] + 1;
  } else if (first < a.num_rows) {
    start = a.target_positions[first];
  }
  const int32_t* table = a.block_table + r * a.block_table_stride;
  for (int64_t j = threadIdx.x; j < a.q_len; j += blockDim.x) {
    const int64_t p = start + j, o = r * a.q_len + j;
    const int64_t blk = min(p / a.block_size, a.max_blocks - 1);
    a.input_ids[o] = static_cast<int32_t>(
        j == 0 ? load_index(a.next_token_ids, a.next_token_ids_int64, r) : a.mask_token_id);
    a.positions[o] = p;
    a.slots[o] = static_cast<int64_t>(table[blk]) * a.block_size + p % a.block_size;
  }
  if (threadIdx.x == 0) {
    a.seq_lens[r] = static_cast<int32_t>(start + a.q_len);
    a.query_start_loc_out[r] = static_cast<int32_t>(r * a.q_len);
  }
}

}  // namespace

cudaError_t launch_prepare_dflash_inputs(const PrepareInputsArgs& args,
                                         cudaStream_t stream) {
  prepare_dflash_inputs_kernel<<<static_cast<unsigned int>(args.batch + 1), 128, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace vllm_dflash::cuda
