"""The CPU's kernels, in one place (as flashinfer/ has FlashInfer's):

  isa.py            what this CPU can do (its flags, or AIOSERVE_CPU_ISA's), the kernels' ISA flags
  dispatch.py       which paths a model takes on those flags (math dtype, matmul, decode, screen), and why
  openmp.py         OpenMP teams per thread (the loop's thread stays single-threaded)
  native.py         the C++ kernels of native/: built on this machine, cached, loaded
  native_build.py   the build (ninja, the system compiler) in a session of its own
  native_progress.py  how far a build is, and how long it has left
  native_lib.py     the built library, loaded with ctypes (which calls keep the GIL)
  native_ops.py     the elementwise and attention kernels for torch tensors
  native_gemm.py    the packed matmul and the greedy screen for torch tensors
  native_decoder.py the DecoderStack (a whole decode step) for torch tensors
  native_kernels.py all of them as one module: what cpu_kernels() hands out
  matmul.py         the packed native matmul, or BLAS in a tuned storage order
  elementwise.py    the switch for the native RMSNorm / RoPE / SiLU-and-mul / attention kernels
  huge_pages.py     2 MiB pages asked for under a large fresh tensor (the KV pool)

All of it sits below the layers (the layers call it) and imports nothing
above it. What puts these kernels together over a model (the native decode
step, the greedy screen, the fast paths' one upgrade point) reads the model
and the KV pool, so it lives a level up, beside the engine, in cpu_engine/.
"""
