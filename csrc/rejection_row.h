// The rejection-sampling accept loop of one request (row), written once for
// the CPU kernel (csrc/cpu/rejection_sample.cpp) and the CUDA kernel
// (csrc/cuda/rejection_sample.cu), so the two cannot drift. Semantics:
// vllm_dflash/ops/reference.py (rejection_sample_ref).
//
// The loop visits the row's draft positions in order and stops at the first
// rejection: greedy rows compare the draft with the argmax of the target row,
// sampled rows accept x with u * q(x) < p(x) (float64) and otherwise emit a
// sample of the residual; an all-accepted row emits the bonus token (given,
// or sampled / argmaxed from its own target row). Each device supplies the
// row-wide reductions (argmax, recover), the rounding of the acceptance
// product and how its threads share the output writes: `Device` has
//   int64_t argmax(const float* row, int64_t vocab)
//   int64_t recover(const float* p, const float* q, int64_t removed,
//                   const float* noise, int64_t vocab)
//   static double mul(double u, double q)
//   int64_t first_lane() / lane_stride()   (CPU: 0 / 1; CUDA: the thread / block size)
// On CUDA every thread of the block runs the loop; the reductions return the
// same value to all of them, so control flow stays uniform.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define VLLM_DFLASH_HOST_DEVICE __host__ __device__
#else
#define VLLM_DFLASH_HOST_DEVICE
#endif

namespace vllm_dflash {

constexpr int32_t kPlaceholderToken = -1;

// Pointers into the op's arguments (csrc/torch_bindings.cpp has the schema).
struct RejectionArgs {
  int32_t* out;                  // [batch, max_spec_len + 1]
  const int32_t* drafts;         // [num_tokens]
  const float* target;           // [num_tokens + batch, vocab], or [num_tokens, vocab] with bonus
  const float* draft_probs;      // [num_tokens, vocab] or null (point-mass drafts)
  const int32_t* bonus;          // [batch] or null (emit from the row's last target row)
  const bool* is_greedy;         // [batch] or null (every row greedy)
  const double* uniforms;        // [num_tokens]
  const float* exp_noise;        // [batch, vocab]
  int64_t vocab;
  int64_t max_spec_len;
};

#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Device>
VLLM_DFLASH_HOST_DEVICE inline void rejection_sample_row(Device& device, const RejectionArgs& a, int64_t b,
                                                         int64_t start, int64_t num_drafts) {
  const int64_t vocab = a.vocab;
  const bool greedy = a.is_greedy == nullptr || a.is_greedy[b];
  // Target row of draft position i; requests own n + 1 rows when the bonus
  // token is sampled here, n rows when the caller passes it.
  const int64_t row_offset = a.bonus == nullptr ? b : 0;
  const float* noise = a.exp_noise != nullptr ? a.exp_noise + b * vocab : nullptr;
  int64_t accepted = 0;
  int64_t final_token = -1;
  for (; accepted < num_drafts; ++accepted) {
    const int64_t t = start + accepted;
    const float* p = a.target + (t + row_offset) * vocab;
    const int64_t x = a.drafts[t];
    const bool in_vocab = x >= 0 && x < vocab;
    if (greedy) {
      const int64_t top = device.argmax(p, vocab);
      if (x != top) {
        final_token = top;
        break;
      }
      continue;
    }
    const double q_x = a.draft_probs == nullptr
                           ? 1.0
                           : (in_vocab ? static_cast<double>(a.draft_probs[t * vocab + x]) : 0.0);
    if (in_vocab && Device::mul(a.uniforms[t], q_x) < static_cast<double>(p[x])) continue;
    const float* q = (in_vocab && a.draft_probs != nullptr) ? a.draft_probs + t * vocab : nullptr;
    const int64_t removed = (in_vocab && a.draft_probs == nullptr) ? x : -1;
    final_token = device.recover(p, q, removed, noise, vocab);
    break;
  }
  if (accepted == num_drafts) {
    if (a.bonus != nullptr) {
      final_token = a.bonus[b];
    } else {
      const float* p = a.target + (start + num_drafts + row_offset) * vocab;
      final_token = greedy ? device.argmax(p, vocab) : device.recover(p, nullptr, -1, noise, vocab);
    }
  }
  int32_t* out_row = a.out + b * (a.max_spec_len + 1);
  for (int64_t j = device.first_lane(); j <= a.max_spec_len; j += device.lane_stride()) {
    out_row[j] = j < accepted    ? a.drafts[start + j]
                 : j == accepted ? static_cast<int32_t>(final_token)
                                 : kPlaceholderToken;
  }
}

}  // namespace vllm_dflash
