"""Quantised checkpoints, in one place: what a quantization_config means,
how its weights load, and the layers' quantised products.

  method.py             QuantMethod: what the weight loader asks of a quantised checkpoint (the seam)
  config.py             a config.json's quantization_config -> its QuantMethod, or a refusal naming the format
  fp8.py                Fp8Config: FP8 e4m3 weights (quant_method "fp8"), the QuantMethod of every FP8 checkpoint
  compressed_tensors.py llm-compressor's compressed-tensors config: its FP8 schemes as an Fp8Config, the rest refused
  fp8_checkpoint.py     an FP8 weight's scale in the checkpoint; a weight dequantised as it is read
  fp8_layers.py         which linear layers hold e4m3 and multiply in FP8, their LinearQuant; the block self-check
  fp8_loading.py        e4m3 values and their scales into such a layer (per row, or its blocks); dummy weights
  fp8_linear.py         per-tensor / per-channel: e4m3 rows times a scale per row, torch's row-wise scaled matmul
  fp8_block_linear.py   128 x 128 blocks: torch's block-scaled matmul, its contract, its self-check

It sits above the layers (a quantised linear layer is one of layers/linear.py's,
given a LinearQuant for its product) and below the models: the model files
do not know it; the weight loader and the linear layers each meet it at
one seam. The next format (AWQ, GPTQ, int8) is a module here implementing
QuantMethod and LinearQuant, and a reader in config.py.
"""
