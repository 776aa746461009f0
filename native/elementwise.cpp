#include <torch/extension.h>

void bind_elementwise(pybind11::module_& m) {}
