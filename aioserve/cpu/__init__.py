"""Everything that runs only on a CPU, in one place (as the FlashInfer side
has kernel_contracts.py, layers/flashinfer_elementwise.py and
attention/flashinfer.py):

  isa.py            what this CPU can do (its flags, or AIOSERVE_CPU_ISA's), the kernels' ISA flags
  openmp.py         OpenMP teams per thread (the loop's thread stays single-threaded)
  native.py         the C++ kernels of native/: built on this machine, cached, loaded
  matmul.py         the packed native matmul, or BLAS in a tuned storage order
  elementwise.py    the switch for the native RMSNorm / RoPE / SiLU-and-mul / attention kernels
  greedy_screen.py  greedy rows' argmax from a half copy of the LM head, exact by a rounding bound
  decode_stack.py   a decode-only step as one native DecoderStack call
  fast_paths.py     the three fast paths behind one object, with one upgrade point between steps

The first five sit below the layers (layers call them); the last two sit at
the engine's level (they read the model and the KV pool); the layering test
ranks each.
"""
