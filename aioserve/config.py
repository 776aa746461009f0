"""Every knob in one place: EngineConfig (model, memory, scheduling) and
ServerArgs (HTTP on top of it). The CLI and the offline API both fill these."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_BYTES = 4 << 30


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    cpu_half_compute: str = "auto"  # auto | native | float32: see engine/dtypes.py
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0  # dummy weights and unseeded sampling
    # KV cache
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_memory: int | None = None  # bytes for the pool on CPU (default 4 GiB, capped by need)
    gpu_memory_utilization: float = 0.85  # share of free GPU memory for the pool
    kv_cache_dtype: str = "auto"  # auto (the weights' dtype) | float32 | bfloat16 | float16
    cache: str = "radix"  # radix | naive
    # Scheduling
    max_model_len: int | None = None  # defaults to the config's max_position_embeddings
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # prefill tokens of one step; longer prompts are chunked
    decode_reserve_tokens: int = 64  # KV room a request must have beyond its prompt to be admitted
    overlap: bool = True  # prepare step N+1 while step N runs
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU
    debug_integrity: bool = False  # check the KV bookkeeping whenever the scheduler goes idle


@dataclass
class ServerArgs:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    chat_template: str | None = None  # a file that overrides the tokenizer's template
    api_key: str | None = None
    tokenizer_workers: int = 4
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
