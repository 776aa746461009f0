"""Everything an engine is built from, decided before its first step: the
device, the checkpoint and its config, the three dtypes, the model with its
weights, the context limit, the prefill budget and the KV pool's size.
`load` returns them as plain data; engine.py builds the pool and the
backends on top."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from aioserve.config import DEFAULT_CPU_KV_BYTES, ConfigError, EngineConfig
from aioserve.cpu.dispatch import CpuDispatch, choose_cpu_dispatch
from aioserve.cpu.isa import cpu_flags
from aioserve.cpu.native import enabled as native_kernels_enabled
from aioserve.engine.draft_model import LoadedDraft, draft_bytes_per_page, load_draft
from aioserve.engine.dtypes import kv_cache_dtype, resolve_dtype
from aioserve.engine.eagle3_draft import LoadedEagle3, eagle3_bytes_per_page, load_eagle3
from aioserve.kvcache.kv_pool import FP8_KV, RESERVED_PAGES, KVPool
from aioserve.layers.moe import FusedMoE
from aioserve.models.causal_lm import CausalLM
from aioserve.models.decoder_lm import DecoderLM
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import resolve_model_path
from aioserve.models.weight_loader import build_model
from aioserve.pooling_config import PoolerConfig, resolve_pooler
from aioserve.cpu.native import cpu_kernels
from aioserve.speculative_config import resolve_speculative

logger = logging.getLogger(__name__)

# Prefill tokens per step when --max-prefill-tokens is not given. On CPU a
# prefill step runs at the matmul rate, so a burst prefilled in one step
# makes every request in it wait for all of them: 64 concurrent 64-token
# prompts on qwen3-0.6b (2 cores) had a mean TTFT of 20 s in one 4096-token
# step and 12 s in chunks of 256, at the same output tok/s (2026-11-23). The
# AMX kernels since then run a chunk's matmuls faster the more rows it has
# (Qwen3-0.6B's layers: 1.1 TFLOP/s at 64 rows, 1.6 at 256, weights from
# memory): the same burst, offline, alternated on a 2-core Xeon with AMX
# (2026-11-28), took 11.1 s in chunks of 256, 10.7 in 512, 10.4-10.7 in
# 1024 and 10.1-10.6 in 2048 (the same 63 decode steps after 4 mixed steps
# instead of 16), and its first requests still see their first token after
# one step of ~0.7 s. On a GPU a big step costs little more than a small one.
DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 8192, "cpu": 1024}


@dataclass
class LoadedModel:
    device: torch.device
    model_path: Path
    model_config: ModelConfig
    weight_dtype: torch.dtype  # what was asked (the weights' values are rounded to it)
    dtype: torch.dtype  # what the math runs in
    kv_dtype: torch.dtype  # what the KV cache holds
    max_model_len: int
    max_prefill_tokens: int
    model: CausalLM  # what every registered architecture builds (models/registry.py)
    num_pages: int  # what this rank's memory holds; ranks then take the smallest
    cpu_dispatch: CpuDispatch | None = None  # on a CPU: its paths for this model (cpu/dispatch.py)
    pooler: PoolerConfig | None = None  # a pooling model (embedder, reranker): how it pools; None: it generates
    draft: LoadedDraft | None = None  # speculative decoding's draft model (the draft_model method)
    eagle3: LoadedEagle3 | None = None  # speculative decoding's EAGLE-3 head (the eagle3 method)


def kv_budget_bytes(total: int, free: int, mem_fraction_static: float) -> int:
    """GPU bytes for the KV pool: the static share of the device's memory
    less what is in use already (weights, the CUDA context, other
    processes). Activations and CUDA graphs live in the remaining share."""
    if not 0 < mem_fraction_static <= 1:
        raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static}")
    return max(0, int(total * mem_fraction_static) - (total - free))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine has no CUDA device torch {torch.__version__} can use")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: aioserve runs on cpu or cuda")
    return device


def _prepare_device(device: torch.device, config: EngineConfig) -> None:
    if device.type == "cpu" and config.num_threads:
        torch.set_num_threads(config.num_threads)
    if device.type == "cuda":
        # cuDNN's attention builds a new plan for every new sequence length
        # (~1.8 ms of CPU per layer call, measured on an H100): serving
        # never repeats a length, so leave SDPA to flash / mem-efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    asked = config.max_model_len
    if asked is not None and asked > limit:
        raise ConfigError(f"--max-model-len {asked} exceeds the model's max_position_embeddings {limit}")
    return asked or limit


def matmul_load_dtype(dispatch: CpuDispatch | None, weight_dtype: torch.dtype) -> torch.dtype | None:
    """Half weights computed in float32 on a CPU whose native kernels are
    built load half: the packed matmul reads them so (see build_model)."""
    if dispatch is None or not dispatch.packed_matmul or dispatch.math_dtype != torch.float32:
        return None
    if weight_dtype == torch.float32:
        return None
    return weight_dtype if cpu_kernels(wait=False) is not None else None


def cpu_dispatch(config: EngineConfig, weight_dtype: torch.dtype, tp_size: int) -> CpuDispatch:
    """This CPU's paths for the model, from its flags and the options, logged once."""
    dispatch = choose_cpu_dispatch(
        cpu_flags(), weight_dtype, cpu_half_compute=config.cpu_half_compute,
        native_kernels=native_kernels_enabled(), matmul_tuning=config.cpu_matmul_tuning,
        decode_graphs=config.cuda_graph, tp_size=tp_size, matmul=config.cpu_matmul,
    )
    for line in dispatch.lines():
        logger.info("CPU path: %s", line)
    return dispatch


def pool_pages(config: EngineConfig, loaded: LoadedModel, tp_size: int) -> int:
    """Pages this rank's memory gives the KV pool: a GPU's static share
    less what is in use, a CPU's --kv-cache-memory; never more than every
    running request at full context could use."""
    if config.num_pages is not None:
        return config.num_pages
    mc = loaded.model_config
    page_bytes = KVPool.bytes_per_page(
        mc.num_layers, config.page_size, mc.kv_heads_per_rank(tp_size), mc.head_dim, loaded.kv_dtype
    )
    if loaded.draft is not None:
        # The draft's pool has as many pages as the target's (the same page
        # ids): each page of the budget pays for both.
        page_bytes += draft_bytes_per_page(loaded.draft.model_config, config.page_size, loaded.kv_dtype, tp_size)
    if loaded.eagle3 is not None:  # likewise the head's pool and its per-slot state
        page_bytes += eagle3_bytes_per_page(
            loaded.eagle3.config, config.page_size, loaded.kv_dtype, loaded.dtype, tp_size
        )
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = kv_budget_bytes(total, free, config.mem_fraction_static)
        if budget < (RESERVED_PAGES + 1) * page_bytes:
            raise ConfigError(
                f"--mem-fraction-static {config.mem_fraction_static} leaves no room for the KV pool: "
                f"{(total - free) / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} GiB are in use already"
            )
    else:
        budget = config.kv_cache_memory or DEFAULT_CPU_KV_BYTES
    pages_per_request = -(-loaded.max_model_len // config.page_size)
    useful = config.max_running_requests * pages_per_request + RESERVED_PAGES
    return max(RESERVED_PAGES + 1, min(budget // page_bytes, useful))


def load(config: EngineConfig, tp_size: int) -> LoadedModel:
    device = resolve_device(config.device)
    _prepare_device(device, config)
    model_path = resolve_model_path(config.model, config.revision)
    model_config = ModelConfig.from_path(model_path)
    # A bad pooling setting is refused before any weight loads.
    pooler = resolve_pooler(config, model_path, model_config.architecture, model_config.is_encoder)
    weight_dtype = resolve_dtype(config.dtype, model_config.torch_dtype)
    dispatch = cpu_dispatch(config, weight_dtype, tp_size) if device.type == "cpu" else None
    dtype = dispatch.math_dtype if dispatch is not None else weight_dtype
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype, weight_dtype, dtype)
    if kv_dtype == FP8_KV and device.type not in ("cuda", "cpu"):
        raise ConfigError(
            f"--kv-cache-dtype {config.kv_cache_dtype} needs a CUDA device or the CPU (FlashInfer's kernels or the "
            f"native ones read an FP8 cache); on {device.type} use auto, bfloat16, float16 or float32"
        )
    model = build_model(
        model_config, model_path, dtype, device, config.load_format, config.seed,
        round_to=weight_dtype, matmul_dtype=matmul_load_dtype(dispatch, weight_dtype),
    )
    if device.type == "cuda":
        # FlashInfer's fused MoE kernel: built and self-checked now, before
        # any request and outside the decode graphs' capture.
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.choose_kernel()
    speculative = resolve_speculative(config)
    draft = None
    if speculative is not None and speculative.draft_model is not None and speculative.method == "draft_model":
        # Loaded before the pool is sized: its weights come out of the memory the pool may take.
        draft = load_draft(config, speculative.draft_model, model_config, dtype, weight_dtype, device)
    eagle3 = None
    if speculative is not None and speculative.draft_model is not None and speculative.method == "eagle3":
        eagle3 = load_eagle3(config, speculative.draft_model, model_config, dtype, weight_dtype, device)
        if not isinstance(model, DecoderLM):
            raise ConfigError(f"an EAGLE-3 head reads a decoder's hidden states; {model_config.architecture} is none")
        model.capture_aux_hidden(eagle3.aux_layers)  # the forward hands the head the target's three states
    loaded = LoadedModel(
        device=device,
        model_path=model_path,
        model_config=model_config,
        weight_dtype=weight_dtype,
        dtype=dtype,
        kv_dtype=kv_dtype,
        max_model_len=max_model_len(config, model_config),
        max_prefill_tokens=_max_prefill_tokens(config, device, model_config),
        model=model,
        num_pages=0,
        cpu_dispatch=dispatch,
        pooler=pooler,
        draft=draft,
        eagle3=eagle3,
    )
    if pooler is not None:
        logger.info("pooling model: %s pooling%s, %s (from %s)", pooler.pooling_type,
                    ", normalised" if pooler.normalize else "", pooler.task, pooler.source)
    loaded.num_pages = pool_pages(config, loaded, tp_size)
    return loaded


def _max_prefill_tokens(config: EngineConfig, device: torch.device, model_config: ModelConfig) -> int:
    """The flag's, or the device's default; an encoder's prompt is computed
    whole in one step (its attention sees the whole sequence), so a step
    holds at least one prompt of the longest context."""
    tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(device.type, 8192)
    if model_config.is_encoder:
        return max(tokens, max_model_len(config, model_config))
    return tokens


def describe(loaded: LoadedModel) -> str:
    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    return (f"loaded {loaded.model_path} ({loaded.model_config.architecture}; weights {name(loaded.weight_dtype)}, "
            f"compute {name(loaded.dtype)}, KV {name(loaded.kv_dtype)}) on {loaded.device}{_threads(loaded.device)}")


def _threads(device: torch.device) -> str:
    """On a CPU, the threads a step uses: the figure to lower with --num-threads
    when other work shares the cores (docs/guide: threads collapse under a
    competing load)."""
    return f" with {torch.get_num_threads()} threads (--num-threads)" if device.type == "cpu" else ""
