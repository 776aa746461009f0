"""The engine: runs batch plans on the device (model, KV pool, sampler)."""
