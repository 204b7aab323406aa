// Rejection-sampling verifier on CPU: torch.ops.vllm_dflash.rejection_sample.
//
// Same semantics as vllm_dflash/ops/reference.py (rejection_sample_ref), which
// documents them; the tests check this kernel against it bit for bit. The
// accept loop of a row is csrc/rejection_row.h, shared with the CUDA kernel;
// this file supplies its CPU reductions. Rows (requests) run in parallel with
// at::parallel_for (OpenMP in PyTorch's CPU builds, sized by
// torch.set_num_threads). A row visits its draft positions in order and stops
// at the first rejection, so it reads one target row per visited position (the
// whole row only for greedy argmax) plus one full row for the recovery or bonus
// sample: O(visited) instead of vLLM's O(num_drafts * vocab) recovery pass.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "../ops_common.h"
#include "../rejection_row.h"
#include "ops.h"

namespace vllm_dflash {
namespace {

// First index of the maximum (torch.argmax semantics for non-NaN rows).
// Two passes: SIMD max, then a SIMD scan for the first index holding it.
// Both use SSE2 (every x86-64 CPU) so the kernel needs no -march flags; other
// CPUs take the scalar loops. ~4x faster than a branchy single pass, and far
// faster than torch.argmax on CPU.
int64_t argmax_row(const float* row, int64_t vocab) {
  const float inf = std::numeric_limits<float>::infinity();
  float best = -inf;
  int64_t v = 0;
#if defined(__SSE2__)
  __m128 m0 = _mm_set1_ps(-inf), m1 = m0, m2 = m0, m3 = m0;
  for (; v + 16 <= vocab; v += 16) {
    m0 = _mm_max_ps(_mm_loadu_ps(row + v), m0);  // max_ps(x, m) == x > m ? x : m
    m1 = _mm_max_ps(_mm_loadu_ps(row + v + 4), m1);
    m2 = _mm_max_ps(_mm_loadu_ps(row + v + 8), m2);
    m3 = _mm_max_ps(_mm_loadu_ps(row + v + 12), m3);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
  for (const float x : lanes) best = x > best ? x : best;
#endif
  for (; v < vocab; ++v) best = row[v] > best ? row[v] : best;
  v = 0;
#if defined(__SSE2__)
  const __m128 target = _mm_set1_ps(best);
  for (; v + 4 <= vocab; v += 4) {
    const int hits = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(row + v), target));
    if (hits != 0) return v + __builtin_ctz(hits);
  }
#endif
  for (; v < vocab; ++v) {
    if (row[v] == best) return v;
  }
  return 0;  // only NaN
}

// Exponential race over [begin, end): each entry scores w(v) / e_v when
// w(v) > 0, else 0, with w = p - q (kHasQ) or p. Two passes like argmax_row:
// the largest score, then the first index reaching it. The SSE2 path does the
// same IEEE float ops as the scalar one, so results are identical.
template <bool kHasQ>
float race_max(const float* p, const float* q, const float* noise, int64_t begin,
               int64_t end) {
  float best = 0.0f;
  int64_t v = begin;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  __m128 m0 = zero, m1 = zero;
  for (; v + 8 <= end; v += 8) {
    __m128 w0 = _mm_loadu_ps(p + v), w1 = _mm_loadu_ps(p + v + 4);
    if (kHasQ) {
      w0 = _mm_sub_ps(w0, _mm_loadu_ps(q + v));
      w1 = _mm_sub_ps(w1, _mm_loadu_ps(q + v + 4));
    }
    const __m128 s0 = _mm_and_ps(_mm_cmpgt_ps(w0, zero), _mm_div_ps(w0, _mm_loadu_ps(noise + v)));
    const __m128 s1 = _mm_and_ps(_mm_cmpgt_ps(w1, zero), _mm_div_ps(w1, _mm_loadu_ps(noise + v + 4)));
    m0 = _mm_max_ps(s0, m0);
    m1 = _mm_max_ps(s1, m1);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(m0, m1));
  for (const float x : lanes) best = x > best ? x : best;
#endif
  for (; v < end; ++v) {
    const float w = kHasQ ? p[v] - q[v] : p[v];
    const float score = w > 0.0f ? w / noise[v] : 0.0f;
    best = score > best ? score : best;
  }
  return best;
}

template <bool kHasQ>
int64_t race_find(const float* p, const float* q, const float* noise, int64_t begin,
                  int64_t end, float best) {
  for (int64_t v = begin; v < end; ++v) {
    const float w = kHasQ ? p[v] - q[v] : p[v];
    if (w > 0.0f && w / noise[v] == best) return v;
  }
  return -1;
}

// First index of max_v w(v) / e_v over w(v) > 0, -1 if none; w = p - q (q
// given) or p with entry `removed` (if >= 0) left out.
int64_t race(const float* p, const float* q, int64_t removed, const float* noise,
             int64_t vocab) {
  if (q != nullptr) {
    const float best = race_max<true>(p, q, noise, 0, vocab);
    return best > 0.0f ? race_find<true>(p, q, noise, 0, vocab, best) : -1;
  }
  const int64_t cut = removed >= 0 ? removed : vocab;
  const int64_t resume = removed >= 0 ? removed + 1 : vocab;
  const float best = std::max(race_max<false>(p, nullptr, noise, 0, cut),
                              race_max<false>(p, nullptr, noise, resume, vocab));
  if (!(best > 0.0f)) return -1;
  const int64_t found = race_find<false>(p, nullptr, noise, 0, cut, best);
  return found >= 0 ? found : race_find<false>(p, nullptr, noise, resume, vocab, best);
}

// Sample of the residual; rounding can empty it, then sample p, then argmax p.
int64_t recover(const float* p, const float* q, int64_t removed,
                const float* noise, int64_t vocab) {
  int64_t token = race(p, q, removed, noise, vocab);
  if (token < 0 && (q != nullptr || removed >= 0)) {
    token = race(p, nullptr, -1, noise, vocab);
  }
  return token >= 0 ? token : argmax_row(p, vocab);
}

// The CPU side of rejection_row.h: one thread per row, SIMD reductions.
struct CpuRow {
  int64_t argmax(const float* row, int64_t vocab) const { return argmax_row(row, vocab); }
  int64_t recover(const float* p, const float* q, int64_t removed, const float* noise, int64_t vocab) const {
    return vllm_dflash::recover(p, q, removed, noise, vocab);
  }
  static double mul(double u, double q) { return u * q; }
  int64_t first_lane() const { return 0; }
  int64_t lane_stride() const { return 1; }
};

}  // namespace

at::Tensor rejection_sample_cpu(
    const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
    const at::Tensor& target_probs, const std::optional<at::Tensor>& draft_probs,
    const std::optional<at::Tensor>& bonus_token_ids,
    const std::optional<at::Tensor>& is_greedy,
    const std::optional<at::Tensor>& uniforms,
    const std::optional<at::Tensor>& exp_noise, int64_t max_spec_len) {
  at::Tensor out = check_rejection_sample_args(
      draft_token_ids, cu_num_draft_tokens, target_probs, draft_probs,
      bonus_token_ids, is_greedy, uniforms, exp_noise, max_spec_len);
  const int64_t batch = cu_num_draft_tokens.size(0);
  const int64_t vocab = target_probs.size(1);
  const int32_t* cu = cu_num_draft_tokens.data_ptr<int32_t>();
  // Validate the row layout serially so errors raise before any work.
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = b == 0 ? 0 : cu[b - 1];
    TORCH_CHECK(cu[b] >= start && cu[b] - start <= max_spec_len,
                "rejection_sample: cu_num_draft_tokens must be non-decreasing "
                "with per-request counts <= max_spec_len (", max_spec_len,
                "); row ", b, " has ", cu[b] - start);
  }
  TORCH_CHECK(batch == 0 || cu[batch - 1] == draft_token_ids.size(0),
              "rejection_sample: cu_num_draft_tokens[-1] must equal "
              "len(draft_token_ids)");

  RejectionArgs args{};
  args.out = out.data_ptr<int32_t>();
  args.drafts = draft_token_ids.data_ptr<int32_t>();
  args.target = target_probs.data_ptr<float>();
  args.draft_probs = draft_probs ? draft_probs->data_ptr<float>() : nullptr;
  args.bonus = bonus_token_ids ? bonus_token_ids->data_ptr<int32_t>() : nullptr;
  args.is_greedy = is_greedy ? is_greedy->data_ptr<bool>() : nullptr;
  args.uniforms = uniforms ? uniforms->data_ptr<double>() : nullptr;
  args.exp_noise = exp_noise ? exp_noise->data_ptr<float>() : nullptr;
  args.vocab = vocab;
  args.max_spec_len = max_spec_len;

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    CpuRow row;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b == 0 ? 0 : cu[b - 1];
      rejection_sample_row(row, args, b, start, cu[b] - start);
    }
  });
  return out;
}

}  // namespace vllm_dflash
