"""LoRA adapters: PEFT folders read and laid out for this rank's layers, and the engine's slots."""
