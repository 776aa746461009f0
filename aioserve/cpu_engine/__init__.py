"""The engine's CPU fast paths: cpu/'s kernels put together over a loaded
model, its LM head and its KV pool.

  greedy_screen.py  greedy rows' argmax from a half copy of the LM head, exact by a rounding bound
  head_argmax.py    greedy rows' argmax from a half LM head as it computes, no logits written
  int8_head_screen.py  greedy steps of a few rows from an int8 copy of a bf16 head (AMX-INT8, VNNI), exact by a bound
  decode_stack.py   a decode-only step as one native DecoderStack call
  fast_paths.py     the fast paths behind one object, with one upgrade point between steps

decode_stack and fast_paths read the model's classes and the KV pool, so
they cannot sit with the kernels in cpu/, below the layers; the engine is
their only caller, so the package sits just under it. Its own package, not
engine/, keeps what runs only on a CPU findable by name: cpu/ for the
kernels, cpu_engine/ for what composes them.
"""
