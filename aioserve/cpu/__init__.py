"""The CPU's kernels, in one place (as the FlashInfer side has
kernel_contracts.py and layers/flashinfer_elementwise.py):

  isa.py            what this CPU can do (its flags, or AIOSERVE_CPU_ISA's), the kernels' ISA flags
  openmp.py         OpenMP teams per thread (the loop's thread stays single-threaded)
  native.py         the C++ kernels of native/: built on this machine, cached, loaded
  matmul.py         the packed native matmul, or BLAS in a tuned storage order
  elementwise.py    the switch for the native RMSNorm / RoPE / SiLU-and-mul / attention kernels

All of it sits below the layers (the layers call it) and imports nothing
above it. What puts these kernels together over a model (the native decode
step, the greedy screen, the fast paths' one upgrade point) reads the model
and the KV pool, so it lives a level up, beside the engine, in cpu_engine/.
"""
