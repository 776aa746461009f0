// CPU kernels for aioserve, JIT-built by aioserve/cpu/native.py with
// torch.utils.cpp_extension (-O3 -march=native: built on the machine that runs it)
// into one Python module. Each kernel has a pure-torch twin in the package,
// and a test checks that both agree. Each source file binds its own kernels.
//
// The kernels keep the GIL while they run (pybind11's default), unlike
// torch's ops. That is deliberate: the forward's OpenMP team already uses
// every core, and the event loop's thread running beside a kernel preempts
// one of its threads, so the whole parallel region waits for it. Measured on
// 2 cores (tiny-llama, 16 concurrent): releasing it lost 10-20% of the
// throughput, streamed or not; the loop runs in the gaps between kernels.
// The exception is decoder.cpp's DecoderStack, a whole decode step in one
// call: held for all of it, the loop could not plan the next step meanwhile
// and every step waited for it (tiny-llama single stream ~230 -> ~280 tok/s,
// 16 concurrent ~1330 -> ~1530 with it released).

#include <torch/extension.h>

void bind_attention(pybind11::module_& m);   // attention.cpp
void bind_gemm(pybind11::module_& m);        // gemm.cpp
void bind_elementwise(pybind11::module_& m); // elementwise.cpp
void bind_decoder(pybind11::module_& m);     // decoder.cpp
void bind_greedy_screen(pybind11::module_& m); // greedy_screen.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_attention(m);
  bind_gemm(m);
  bind_elementwise(m);
  bind_decoder(m);
  bind_greedy_screen(m);
}
