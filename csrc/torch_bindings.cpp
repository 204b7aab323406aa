// Schemas of the vllm_dflash ops and the Python module entry point.
//
// Device implementations register themselves with TORCH_LIBRARY_IMPL in their
// own files (csrc/cpu/*.cpp for CPU, csrc/cuda_bindings.cpp for CUDA); fake
// (meta) implementations for torch.compile live in vllm_dflash/ops.py. Other
// ops add their schemas with TORCH_LIBRARY_FRAGMENT(vllm_dflash, m).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(vllm_dflash, m) {
  // Concatenate rows `indices` of L hidden-state tensors [T, D] into a
  // contiguous [n, L*D] tensor (the DFlash draft's fc input).
  m.def("gather_hidden_states(Tensor[] hidden_states, Tensor indices) -> Tensor");
  m.def(
      "gather_hidden_states_out(Tensor[] hidden_states, Tensor indices, "
      "Tensor(a!) out) -> ()");
  // Scatter context K/V [n, H, d] into one layer of vLLM's paged KV cache.
  m.def(
      "write_context_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, str layout) -> ()");
  // Context K/V of every draft layer from projected keys/values [n, L, H, d]:
  // per-head RMSNorm of K (the layer's k_norm weight), RoPE at `positions`
  // from vLLM's cos_sin_cache, both written into each layer's paged cache.
  m.def(
      "context_kv_write(Tensor key, Tensor value, Tensor k_norm_weight, "
      "float eps, Tensor cos_sin_cache, Tensor positions, bool is_neox, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, str layout) -> ()");
  // RMSNorm over the last dim with vLLM's native rounding: fp32 statistics,
  // x * rsqrt(mean(x^2) + eps) rounded to the dtype, times the weight.
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  // One drafting step's inputs from the runner's batch: context rows (the
  // verified target rows, their positions and slots) and the query block
  // [bonus, MASK x k] (ids, positions, slots), the block's seq_lens and
  // query_start_loc.
  m.def(
      "prepare_dflash_inputs(Tensor query_start_loc, Tensor? num_rejected, "
      "Tensor target_positions, Tensor slot_mapping, Tensor next_token_ids, "
      "Tensor block_table, int block_size, int mask_token_id, "
      "int num_speculative_tokens, int num_rows, bool compact) -> "
      "(Tensor context_rows, Tensor context_positions, Tensor context_slots, "
      "Tensor input_ids, Tensor positions, Tensor slots, Tensor seq_lens, "
      "Tensor query_start_loc_out)");
}

// `import vllm_dflash._C` loads the library (and with it the registrations
// above); the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                      nullptr};
  return PyModule_Create(&module);
}
