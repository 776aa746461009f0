"""FlashInfer's CUDA kernels as aioserve calls them, and what each requires
of its arguments, in one place (as cpu/ has the CPU's):

  loader.py         the optional `flashinfer` module (the gpu extra): imported once, or why not
  contracts.py      what each kernel aioserve calls requires (dtypes, layout, alignment, shapes)
  elementwise.py    the fused RMSNorm / RoPE / SiLU-and-mul / GeGLU ops, taken per layout where the contract holds
  moe.py            the fused MoE kernel for a FusedMoE layer: contract, self-check, weight order
  paged_args.py     a batch plan's pages as the paged wrappers' indptr / indices / last_page_len

All of it sits below the layers (the layers call it) and imports nothing
else of aioserve. The attention backend that plans and runs the paged
decode and prefill wrappers is an attention concept (it implements
attention/backend.py), so it stays in attention/flashinfer.py and reads
the loader, the contracts and paged_args.py from here.
"""
