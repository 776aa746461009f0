"""The engine: model weights, the KV pool and one method, `forward(plan)`.

It holds no request state. Everything a step needs comes in the plan, so any
engine built from the same checkpoint (another rank, a test's second
instance) runs the same plan to the same tokens.

Under tensor parallelism every rank runs `launch(plan)` on its shard; only
rank 0 samples, and the sampled tokens are broadcast to the others, so every
rank records the same tokens for the next step's placeholders whatever its
float rounding.
"""

from __future__ import annotations

import logging

import torch

from aioserve.attention import AttentionShape, create_backend
from aioserve.batch_plan import BatchPlan, StepOutput
from aioserve.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from aioserve.distributed import broadcast_from_leader, get_tp_group, min_over_ranks
from aioserve.engine.cuda_graph import Capture, CudaGraphCapture, DecodeGraphRunner
from aioserve.engine.dtypes import compute_dtype, kv_cache_dtype, resolve_dtype
from aioserve.engine.greedy_screen import GreedyScreen
from aioserve.engine.native_decode import NativeDecodeRunner, unsupported_reason
from aioserve.layers.cpu_matmul import pack_cpu_weights, tune_cpu_matmuls
from aioserve.engine.sampler import sample
from aioserve.engine.tp_layout import gather_layout, layout_lines
from aioserve.kvcache.kv_pool import RESERVED_PAGES, KVPool
from aioserve.models.model_config import ModelConfig
from aioserve.models.source import resolve_model_path
from aioserve.models.weight_loader import build_model
from aioserve.native import cpu_kernels
from aioserve.placeholders import PreviousStepTokens

logger = logging.getLogger(__name__)


# Prefill tokens per step when --max-prefill-tokens is not given. On CPU a
# prefill step runs at the matmul rate, so a burst prefilled in one step
# makes every request in it wait for all of them: 64 concurrent 64-token
# prompts on qwen3-0.6b (2 cores) had a mean TTFT of 20 s in one 4096-token
# step and 12 s in chunks of 256, at the same output tok/s. On a GPU a big
# step costs little more than a small one.
DEFAULT_MAX_PREFILL_TOKENS = {"cuda": 8192, "cpu": 256}


def kv_budget_bytes(total: int, free: int, mem_fraction_static: float) -> int:
    """GPU bytes for the KV pool: the static share of the device's memory
    less what is in use already (weights, the CUDA context, other
    processes). Activations and CUDA graphs live in the remaining share."""
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
    return max(0, int(total * mem_fraction_static) - (total - free))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = get_tp_group()
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cuda":
            # cuDNN's attention builds a new plan for every new sequence length
            # (~1.8 ms of CPU per layer call, measured on an H100): serving
            # never repeats a length, so leave SDPA to flash / mem-efficient.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model_path = resolve_model_path(config.model, config.revision)
        self.model_config = ModelConfig.from_path(self.model_path)
        # `weight_dtype` is what was asked; `dtype` is what the math uses; `kv_dtype` what the cache holds.
        self.weight_dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype)
        self.dtype = compute_dtype(self.weight_dtype, self.device, config.cpu_half_compute)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype, self.weight_dtype, self.dtype)
        self.max_model_len = self._max_model_len()
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS.get(self.device.type, 8192)
        self.model = build_model(
            self.model_config, self.model_path, self.dtype, self.device, config.load_format, config.seed,
            round_to=self.weight_dtype, matmul_dtype=self._matmul_load_dtype(),
        )
        # CPU weights waiting to be packed for the native matmul: a first
        # start serves with BLAS (tuned) while the kernels build, and packs
        # them at the first step after they are in.
        self._unpacked: list[torch.nn.Module] = []
        if self.device.type == "cpu":
            matmuls = [m for m in self.model.modules() if hasattr(m, "matmul_choice")]
            if not pack_cpu_weights(matmuls, self.weight_dtype, self.dtype):
                for module in matmuls:  # BLAS multiplies at the math's width
                    module.weight.data = module.weight.data.to(self.dtype)
                self._unpacked = matmuls
                if config.cpu_matmul_tuning:
                    tune_cpu_matmuls(matmuls)
        self.page_size = config.page_size
        # Free memory differs between ranks: every rank takes the smallest
        # pool any of them can hold, so one page id means one page everywhere.
        self.num_pages = min_over_ranks(self._num_pages())
        self.pool = KVPool(
            self.model_config.num_layers,
            self.num_pages,
            self.page_size,
            self.model_config.kv_heads_per_rank(self.tp.size),
            self.model_config.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.attention_shape = shape = AttentionShape(
            num_qo_heads=self.model_config.num_heads // self.tp.size,
            num_kv_heads=self.model_config.kv_heads_per_rank(self.tp.size),
            head_dim=self.model_config.head_dim,
            sliding_windows=tuple(self.model_config.sliding_windows),
            q_dtype=self.dtype,
        )
        self.attention = create_backend(config.attention_backend, self.pool, shape)
        # Decode-only steps run as one captured unit where they can: CUDA
        # graphs on a GPU, the native DecoderStack on a CPU.
        self.graph_runner: DecodeGraphRunner | NativeDecodeRunner | None = None
        if self.device.type == "cuda" and config.cuda_graph:
            if self.attention.supports_graphs:
                self.graph_runner = self.capture_decode_graphs(CudaGraphCapture())
            else:
                logger.info("CUDA graphs off: the %s attention backend cannot replay", self.attention.name)
        self._start_native_decode()
        self.greedy_screen: GreedyScreen | None = None
        self._start_greedy_screen()
        self.previous = PreviousStepTokens(self.device)  # fills the next plan's placeholders
        # What every rank holds (gathered from all of them; equal on every rank).
        self.tp_layout = gather_layout(self)
        logger.info(
            "loaded %s (%s; weights %s, compute %s, KV %s) on %s; KV pool: %d pages x %d = %d tokens",
            self.model_path,
            self.model_config.architecture,
            str(self.weight_dtype).removeprefix("torch."),
            str(self.dtype).removeprefix("torch."),
            str(self.kv_dtype).removeprefix("torch."),
            self.device,
            self.num_pages,
            self.page_size,
            self.kv_capacity_tokens,
        )
        if self.tp.size > 1 and self.tp.is_leader:
            for line in layout_lines(self.tp_layout):
                logger.info("tensor parallel: %s", line)

    def _matmul_load_dtype(self) -> torch.dtype | None:
        """Half weights computed in float32 on a CPU whose native kernels are
        built load half: the packed matmul reads them so (see build_model)."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or self.weight_dtype == torch.float32:
            return None
        return self.weight_dtype if cpu_kernels(wait=False) is not None else None

    @property
    def attention_backend_name(self) -> str:
        """As --attention-backend spells it: what `auto` chose."""
        return self.attention.name

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the pool can hold (the reserved page excluded)."""
        return (self.num_pages - RESERVED_PAGES) * self.page_size

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {limit}")
        return asked or limit

    def _num_pages(self) -> int:
        cfg = self.config
        if cfg.num_pages is not None:
            return cfg.num_pages
        kv_heads = self.model_config.kv_heads_per_rank(self.tp.size)
        page_bytes = KVPool.bytes_per_page(
            self.model_config.num_layers, self.page_size, kv_heads, self.model_config.head_dim, self.kv_dtype
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_budget_bytes(total, free, cfg.mem_fraction_static)
            if budget < (RESERVED_PAGES + 1) * page_bytes:
                raise ValueError(
                    f"--mem-fraction-static {cfg.mem_fraction_static} leaves no room for the KV pool: "
                    f"{(total - free) / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} GiB are in use already"
                )
        else:
            budget = cfg.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        # Never more than every running request at full context could use.
        pages_per_request = -(-self.max_model_len // self.page_size)
        useful = cfg.max_running_requests * pages_per_request + RESERVED_PAGES
        return max(RESERVED_PAGES + 1, min(budget // page_bytes, useful))

    def capture_decode_graphs(self, capture: Capture) -> DecodeGraphRunner:
        """Capture the decode graphs (CUDA: after the pool exists, since they
        bake in its address); logs their time and memory."""
        on_cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        runner = DecodeGraphRunner(
            self.model, self.attention, self.model_config.hidden_size, self.dtype, self.device,
            max_bs=min(self.config.cuda_graph_max_bs, self.config.max_running_requests),
            max_pages_per_request=-(-self.max_model_len // self.page_size),
            capture=capture,
        )
        used = (free_before - torch.cuda.mem_get_info(self.device)[0]) if on_cuda else 0
        logger.info(
            "captured decode graphs for batch sizes %d..%d (%d graphs) in %.1f s, %.0f MiB",
            runner.batch_sizes[0], runner.max_bs, len(runner.batch_sizes), runner.capture_seconds, used / 2**20,
        )
        return runner

    def _start_native_decode(self) -> None:
        """On CPU, decode-only steps through the native DecoderStack when it
        can run this model (otherwise, once, the reason in the log)."""
        if self.device.type != "cpu" or not self.config.cuda_graph:
            return
        reason = unsupported_reason(self.model, self.device)
        if reason is None:
            kernels = cpu_kernels(wait=False)
            assert kernels is not None
            self.graph_runner = NativeDecodeRunner(self.model, self.pool, kernels)
            logger.info("decode-only steps run as one native call (DecoderStack)")
        elif not self._unpacked:  # while the kernels build, packing comes later and this is retried
            logger.info("decode steps run the modules: %s", reason)

    def _start_greedy_screen(self) -> None:
        """On CPU, once the LM head is packed in float32: greedy rows' argmax
        from a float16 copy of it (greedy_screen.py)."""
        lm_head = getattr(self.model, "lm_head", None)
        kernels = cpu_kernels(wait=False)
        if self.device.type == "cpu" and lm_head is not None and kernels is not None:
            self.greedy_screen = GreedyScreen.build(lm_head, kernels, self.tp.size)

    def forward(self, plan: BatchPlan) -> StepOutput:
        """Run one step and wait for it: the output is on the CPU."""
        output = self.launch(plan)
        if self.device.type == "cpu":
            return output
        output = output.to(torch.device("cpu"))
        torch.cuda.current_stream(self.device).synchronize()  # the copies are asynchronous
        return output

    @torch.inference_mode()
    def launch(self, plan: BatchPlan) -> StepOutput:
        """Enqueue one step on the current stream; the output stays on the
        device. Followers return only the tokens (what rank 0 sampled)."""
        try:
            return self._launch(plan)
        except Exception:
            # The scheduler fails this step's requests, but the next plan may
            # already name its tokens by placeholder (overlap). Stand-in tokens
            # (0) keep that plan runnable: the rows naming them belong to the
            # failed requests, whose outputs are dropped, and the requests
            # admitted with it go on.
            rows = plan.logits_indices.shape[0] if plan.sampling is not None else 0
            self.previous.record(plan.step, torch.zeros(rows, dtype=torch.long, device=self.device))
            raise

    def _launch(self, plan: BatchPlan) -> StepOutput:
        # Between steps, on the thread that runs them: nothing else reads the weights.
        if self._unpacked and cpu_kernels(wait=False) is not None:
            pack_cpu_weights(self._unpacked, self.weight_dtype, self.dtype)
            self._unpacked = []
            self._start_native_decode()
            self._start_greedy_screen()
        host_plan, plan = plan, plan.to(self.device)
        input_ids = self.previous.resolve(plan.step, plan.input_ids, host_plan.input_ids)
        if self.graph_runner is not None and self.graph_runner.can_run(host_plan):
            hidden = self.graph_runner.run(input_ids, plan, host_plan)
        else:
            hidden = self.model(input_ids, plan.positions, self.attention.prepare(plan, host_plan))
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        output = StepOutput(next_token_ids=empty, logprobs=empty.float(), top_ids=None, top_logprobs=None)
        sampled_rows = hidden[plan.logits_indices] if plan.sampling is not None else None
        screened = self._screened_tokens(sampled_rows, host_plan)
        if screened is not None:
            output.next_token_ids, output.logprobs = screened, torch.zeros(screened.shape[0])
        elif sampled_rows is not None:
            # The LM head gathers the vocabulary shards: every rank takes part.
            logits = self.model.compute_logits(sampled_rows)
            if self.tp.is_leader:
                self._sample(logits, plan, host_plan, output)
            else:
                output.next_token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=self.device)
            broadcast_from_leader(output.next_token_ids)
        self.previous.record(plan.step, output.next_token_ids)
        if plan.prompt_logprobs is not None:
            logits = self.model.compute_logits(hidden[plan.prompt_logprobs.token_indices])
            if self.tp.is_leader:
                self._prompt_logprobs(logits, plan, output)
        return output

    def _screened_tokens(self, sampled_rows: torch.Tensor | None, host_plan: BatchPlan) -> torch.Tensor | None:
        """The step's tokens by the greedy screen, when it serves every row."""
        st = host_plan.sampling
        if self.greedy_screen is None or sampled_rows is None or st is None or not st.takes_raw_argmax:
            return None
        return self.greedy_screen.argmax(sampled_rows)

    def _sample(self, logits: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan, output: StepOutput) -> None:
        st = plan.sampling
        assert st is not None
        if st.has_penalties:
            host_st = host_plan.sampling
            assert host_st is not None
            st.output_token_ids = self.previous.resolve(plan.step, st.output_token_ids, host_st.output_token_ids)
            st.seen_token_ids = self.previous.resolve(plan.step, st.seen_token_ids, host_st.seen_token_ids)
        sampled = sample(logits, st)
        output.next_token_ids, output.logprobs = sampled.token_ids, sampled.logprobs
        output.top_ids, output.top_logprobs = sampled.top_ids, sampled.top_logprobs

    def _prompt_logprobs(self, logits: torch.Tensor, plan: BatchPlan, output: StepOutput) -> None:
        request = plan.prompt_logprobs
        assert request is not None
        normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        output.prompt_logprobs = (logits.gather(1, request.target_ids[:, None]) - normalizer).squeeze(1)
        if request.num_top:
            values, output.prompt_top_ids = logits.topk(request.num_top, dim=-1)
            output.prompt_top_logprobs = values - normalizer
