// CPU kernels for aioserve, built by aioserve/cpu/native.py with the system
// C++ compiler (-O3 -march=native: built on the machine that runs it) into
// one plain shared library, loaded with ctypes (aioserve/cpu/native_lib.py).
// Each kernel has a pure-torch twin in the package, and a test checks that
// both agree. Each source file exports its kernels as `extern "C"`
// functions that take data pointers, sizes and strides and return 0, or 1
// with the message in aioserve_last_error().
//
// The kernels keep the GIL while they run (ctypes.PyDLL), unlike torch's
// ops. That is deliberate: the forward's OpenMP team already uses every
// core, and the event loop's thread running beside a kernel preempts one of
// its threads, so the whole parallel region waits for it. Measured on 2
// cores (tiny-llama, 16 concurrent): releasing it lost 10-20% of the
// throughput, streamed or not; the loop runs in the gaps between kernels.
// The exception is decoder.cpp's DecoderStack, a whole decode step in one
// call (ctypes.CDLL, which releases the GIL): held for all of it, the loop
// could not plan the next step meanwhile and every step waited for it
// (tiny-llama single stream ~230 -> ~280 tok/s, 16 concurrent ~1330 -> ~1530
// with it released).

#include "kernels.h"

#include <string>

namespace {

thread_local std::string last_error;

}  // namespace

void aioserve::set_error(const char* message) { last_error = message; }

extern "C" {

// The calling thread's last failure's message (valid until its next failure).
const char* aioserve_last_error() { return last_error.c_str(); }

// Which interface this library speaks: aioserve/cpu/native_lib.py refuses another.
int aioserve_abi_version() { return 10; }

}  // extern "C"
