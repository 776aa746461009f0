"""Decoder-only transformer models loaded from Hugging Face checkpoints."""
