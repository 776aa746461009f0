// CPU kernels for aioserve, JIT-built by aioserve/native.py with
// torch.utils.cpp_extension (-O3 -march=native: built on the machine that runs it)
// into one Python module. Each kernel has a pure-torch twin in the package,
// and a test checks that both agree. Each source file binds its own kernels.

#include <torch/extension.h>

void bind_attention(pybind11::module_& m);   // attention.cpp
void bind_gemm(pybind11::module_& m);        // gemm.cpp
void bind_elementwise(pybind11::module_& m); // elementwise.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_attention(m);
  bind_gemm(m);
  bind_elementwise(m);
}
