"""Building blocks of the models: tensor-parallel linears and embeddings, norms, RoPE."""
