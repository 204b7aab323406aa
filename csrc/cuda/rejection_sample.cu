// Rejection-sampling verifier on CUDA: one thread block per request.
//
// Same semantics as vllm_dflash/ops/reference.py (and the CPU kernel); the
// tests check all three agree bit for bit. The accept loop of a row is
// csrc/rejection_row.h, shared with the CPU kernel; this file supplies its
// block-wide reductions. The block walks the request's draft positions in
// order: sampled rows need one scalar test per position, greedy rows one
// block-wide argmax; the first rejection (or the bonus) costs one block-wide
// exponential race over the vocabulary. Every decision is uniform across the
// block, so all threads follow the same control flow. Arithmetic uses explicit
// round-to-nearest intrinsics so that --use_fast_math cannot change results.

#include "../rejection_row.h"
#include "launchers.h"

namespace vllm_dflash::cuda {
namespace {

constexpr int kWarpSize = 32;

// A candidate of an argmax; index < 0 means "none". Larger value wins, ties go
// to the lower index: a total order, so any reduction tree gives torch.argmax's
// "first maximal index".
struct Best {
  float value;
  int64_t index;
};

__device__ __forceinline__ Best prefer(Best a, Best b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ __forceinline__ Best warp_best(Best local) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    Best other;
    other.value = __shfl_xor_sync(0xffffffffu, local.value, offset);
    other.index = __shfl_xor_sync(0xffffffffu, local.index, offset);
    local = prefer(local, other);
  }
  return local;
}

// Reduces one candidate per thread; every thread gets the result.
template <int kThreads>
__device__ Best block_best(Best local, Best* shared) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  local = warp_best(local);
  if (lane == 0) shared[warp] = local;
  __syncthreads();
  if (warp == 0) {
    local = lane < kWarps ? shared[lane] : Best{0.0f, -1};
    local = warp_best(local);
    if (lane == 0) shared[kWarps] = local;
  }
  __syncthreads();
  const Best result = shared[kWarps];
  __syncthreads();  // `shared` is reused by the next reduction
  return result;
}

template <int kThreads>
__device__ int64_t block_argmax(const float* row, int64_t vocab, Best* shared) {
  Best local{0.0f, -1};
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    local = prefer(local, Best{row[v], v});
  }
  const Best best = block_best<kThreads>(local, shared);
  return best.index < 0 ? 0 : best.index;
}

// Exponential race: first index of max_v w(v) / e_v over w(v) > 0, -1 if none;
// w = p - q (q given), p with `removed` zeroed, or p.
template <int kThreads>
__device__ int64_t block_race(const float* p, const float* q, int64_t removed,
                              const float* noise, int64_t vocab, Best* shared) {
  Best local{0.0f, -1};
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float w = q != nullptr ? __fsub_rn(p[v], q[v]) : (v == removed ? 0.0f : p[v]);
    if (w > 0.0f) {
      const float score = __fdiv_rn(w, noise[v]);
      if (score > 0.0f) local = prefer(local, Best{score, v});
    }
  }
  return block_best<kThreads>(local, shared).index;
}

template <int kThreads>
__device__ int64_t block_recover(const float* p, const float* q, int64_t removed,
                                 const float* noise, int64_t vocab, Best* shared) {
  int64_t token = block_race<kThreads>(p, q, removed, noise, vocab, shared);
  if (token < 0 && (q != nullptr || removed >= 0)) {
    token = block_race<kThreads>(p, nullptr, -1, noise, vocab, shared);
  }
  return token >= 0 ? token : block_argmax<kThreads>(p, vocab, shared);
}

// The CUDA side of rejection_row.h: every thread of the block runs the loop;
// reductions are block-wide and hand their result to all threads.
template <int kThreads>
struct CudaBlock {
  Best* shared;
  __device__ int64_t argmax(const float* row, int64_t vocab) {
    return block_argmax<kThreads>(row, vocab, shared);
  }
  __device__ int64_t recover(const float* p, const float* q, int64_t removed, const float* noise,
                             int64_t vocab) {
    return block_recover<kThreads>(p, q, removed, noise, vocab, shared);
  }
  static __device__ double mul(double u, double q) { return __dmul_rn(u, q); }
  __device__ int64_t first_lane() const { return threadIdx.x; }
  __device__ int64_t lane_stride() const { return kThreads; }
};

template <int kThreads>
__global__ void __launch_bounds__(kThreads) rejection_sample_kernel(RejectionArgs args,
                                                                   const int32_t* __restrict__ cu) {
  __shared__ Best shared[kThreads / kWarpSize + 1];
  const int64_t b = blockIdx.x;
  const int64_t start = b == 0 ? 0 : cu[b - 1];
  // Clamp so a malformed cu (unchecked on device) cannot write out of bounds.
  const int64_t num_drafts = min(max(static_cast<int64_t>(cu[b]) - start, int64_t{0}), args.max_spec_len);
  CudaBlock<kThreads> block{shared};
  rejection_sample_row(block, args, b, start, num_drafts);
}

}  // namespace

cudaError_t launch_rejection_sample(
    int32_t* out, const int32_t* draft_token_ids, const int32_t* cu_num_draft,
    const float* target_probs, const float* draft_probs,
    const int32_t* bonus_token_ids, const bool* is_greedy,
    const double* uniforms, const float* exp_noise, int64_t batch,
    int64_t vocab, int64_t max_spec_len, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(batch));
  RejectionArgs args{out, draft_token_ids, target_probs, draft_probs, bonus_token_ids,
                     is_greedy, uniforms, exp_noise, vocab, max_spec_len};
  // Large vocabularies: more threads per row-wide reduction.
  if (vocab >= 16384) {
    rejection_sample_kernel<1024><<<grid, 1024, 0, stream>>>(args, cu_num_draft);
  } else {
    rejection_sample_kernel<256><<<grid, 256, 0, stream>>>(args, cu_num_draft);
  }
  return cudaGetLastError();
}

}  // namespace vllm_dflash::cuda
