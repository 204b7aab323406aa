// CPU gather of target hidden states into the DFlash fc input.
//
// Each output row is L plain row copies, so the result is bit-identical to
// torch.cat([h[indices] for h in hidden_states], dim=-1) for every dtype.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../ops_common.h"
#include "ops.h"

namespace vllm_dflash {
namespace {

template <typename index_t>
void check_index_range(const index_t* idx, int64_t n, int64_t num_rows) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = static_cast<int64_t>(idx[i]);
    TORCH_CHECK_VALUE(r >= 0 && r < num_rows, "gather_hidden_states: indices[",
                      i, "] = ", r, " is out of range for hidden_states with ",
                      num_rows, " rows; indices must lie in [0, ", num_rows,
                      ")");
  }
}

template <typename index_t>
void copy_rows(const std::vector<const char*>& src,
               const std::vector<int64_t>& src_stride_bytes,
               const index_t* idx, int64_t n, int64_t row_bytes, char* out) {
  const int64_t num_layers = static_cast<int64_t>(src.size());
  const int64_t out_row_bytes = num_layers * row_bytes;
  // ~64 KiB per task keeps small gathers single-threaded.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(out_row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = static_cast<int64_t>(idx[i]);
      char* dst = out + i * out_row_bytes;
      for (int64_t l = 0; l < num_layers; ++l) {
        std::memcpy(dst + l * row_bytes, src[l] + r * src_stride_bytes[l],
                    row_bytes);
      }
    }
  });
}

void gather_into(at::TensorList hidden_states, const at::Tensor& indices,
                 const at::Tensor& out, const GatherShape& s) {
  const at::Tensor idx = indices.contiguous();
  if (idx.scalar_type() == at::kLong) {
    check_index_range(idx.data_ptr<int64_t>(), s.n, s.num_rows);
  } else {
    check_index_range(idx.data_ptr<int32_t>(), s.n, s.num_rows);
  }
  if (s.n == 0 || s.hidden == 0) return;

  std::vector<at::Tensor> keep_alive;
  std::vector<const char*> src;
  std::vector<int64_t> src_stride_bytes;
  for (const at::Tensor& h : hidden_states) {
    keep_alive.push_back(dense_rows(h));
    const at::Tensor& t = keep_alive.back();
    src.push_back(static_cast<const char*>(t.const_data_ptr()));
    src_stride_bytes.push_back(t.stride(0) * t.element_size());
  }
  const int64_t row_bytes = s.hidden * hidden_states[0].element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  if (idx.scalar_type() == at::kLong) {
    copy_rows(src, src_stride_bytes, idx.data_ptr<int64_t>(), s.n, row_bytes, dst);
  } else {
    copy_rows(src, src_stride_bytes, idx.data_ptr<int32_t>(), s.n, row_bytes, dst);
  }
}

}  // namespace

at::Tensor gather_hidden_states_cpu(at::TensorList hidden_states,
                                    const at::Tensor& indices) {
  const GatherShape s = check_gather_inputs(hidden_states, indices);
  at::Tensor out =
      at::empty({s.n, s.num_layers * s.hidden}, hidden_states[0].options());
  gather_into(hidden_states, indices, out, s);
  return out;
}

void gather_hidden_states_out_cpu(at::TensorList hidden_states,
                                  const at::Tensor& indices, at::Tensor& out) {
  const GatherShape s = check_gather_inputs(hidden_states, indices);
  check_gather_out(out, s, hidden_states[0]);
  gather_into(hidden_states, indices, out, s);
}

}  // namespace vllm_dflash
