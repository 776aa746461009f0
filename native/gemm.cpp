#include <torch/extension.h>

void bind_gemm(pybind11::module_& m) {}
