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
}

// `import vllm_dflash._C` loads the library (and with it the registrations
// above); the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                      nullptr};
  return PyModule_Create(&module);
}
