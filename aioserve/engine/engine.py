"""The engine: model weights, the KV pool and one method, `forward(plan)`.

It holds no request state. Everything a step needs comes in the plan, so any
engine built from the same checkpoint (another rank, a test's second
instance) runs the same plan to the same tokens.

Under tensor parallelism every rank runs `launch(plan)` on its shard; only
rank 0 samples, and the sampled tokens are broadcast to the others, so every
rank records the same tokens for the next step's placeholders whatever its
float rounding.

What it is built from (device, dtypes, weights, pool size) is decided in
loading.py; the CPU's native fast paths live behind cpu_engine/fast_paths.py.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import cast

import torch
from torch import nn

from aioserve.attention import create_backend
from aioserve.batch_plan import BatchPlan, SamplingTensors, StepOutput
from aioserve.config import EngineConfig
from aioserve.tp.distributed import broadcast_from_leader, get_tp_group, min_over_ranks
from aioserve.cpu_engine.fast_paths import CpuFastPaths
from aioserve.engine.cuda_graph import Capture, CudaGraphCapture, DecodeGraphRunner, GraphTarget, replaying
from aioserve.engine.draft_runner import DraftRunner
from aioserve.engine.eagle3_runner import Eagle3Runner
from aioserve.cpu_engine.greedy_screen import GreedyScreen
from aioserve.cpu_engine.head_argmax import HeadArgmax
from aioserve.engine.image_embeddings import ImageEmbeddings
from aioserve.engine.loading import describe, load
from aioserve.engine.pooler import pool_segments, score_head_of
from aioserve.engine.rank_attention import rank_attention_shape
from aioserve.cpu_engine.decode_stack import NativeDecodeRunner
from aioserve.engine.sampler import SamplerOutput, prompt_logprobs, sample
from aioserve.engine.tp_layout import gather_layout, layout_lines
from aioserve.engine.verify_graph import VerifyGraphRunner
from aioserve.kvcache.kv_pool import RESERVED_PAGES, KVPool
from aioserve.lora.adapter_slots import AdapterSlots
from aioserve.lora_config import resolve_lora
from aioserve.models.causal_lm import VisionLanguageModel, vision_language
from aioserve.placeholders import PreviousStepTokens
from aioserve.speculative_config import resolve_speculative

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp = get_tp_group()
        loaded = load(config, self.tp.size)
        self.device, self.model_path, self.model_config = loaded.device, loaded.model_path, loaded.model_config
        # `weight_dtype` is what was asked; `dtype` is what the math uses; `kv_dtype` what the cache holds.
        self.weight_dtype, self.dtype, self.kv_dtype = loaded.weight_dtype, loaded.dtype, loaded.kv_dtype
        self.max_model_len, self.max_prefill_tokens = loaded.max_model_len, loaded.max_prefill_tokens
        self.model = loaded.model
        self.pooler = loaded.pooler  # a pooling model: how it pools (pooling_config.py); None: it generates
        # A reranker's score head (its classifier, or two tokens' logits) and the row it reads.
        self.score_head, self.score_row = score_head_of(self.model, self.pooler, Path(config.tokenizer or self.model_path))
        self.page_size = config.page_size
        # Free memory differs between ranks: every rank takes the smallest
        # pool any of them can hold, so one page id means one page everywhere.
        self.num_pages = min_over_ranks(loaded.num_pages)
        mc = self.model_config
        self.attention_shape = rank_attention_shape(mc, self.tp.size, self.dtype, causal=not mc.is_encoder)
        shape = self.attention_shape
        self.pool = KVPool(mc.num_layers, self.num_pages, self.page_size, shape.num_kv_heads, shape.head_dim,
                           self.kv_dtype, self.device)
        self.attention = create_backend(config.attention_backend, self.pool, self.attention_shape)
        # Speculative decoding's draft model: its own pool, on the target's pages.
        self.draft: DraftRunner | None = None
        if loaded.draft is not None:
            self.draft = DraftRunner(loaded.draft, self.num_pages, self.page_size, self.kv_dtype, self.dtype,
                                     config.attention_backend, self.device, self.tp.size)
        # Or an EAGLE-3 head: the target's forward also returns the three hidden states it reads.
        self.eagle3: Eagle3Runner | None = None
        if loaded.eagle3 is not None:
            self.eagle3 = Eagle3Runner(loaded.eagle3, self.model.embed_tokens, self.num_pages, self.page_size,
                                       self.kv_dtype, self.dtype, config.attention_backend, self.device,
                                       self.tp.size)
        # LoRA adapters: every adaptable layer's slots (lora/adapter_slots.py).
        lora = resolve_lora(config)
        self.lora: AdapterSlots | None = None
        if lora is not None:
            self.lora = AdapterSlots(cast(nn.Module, self.model), mc, lora, self.dtype, self.device, self.weight_dtype)
            logger.info("LoRA: %d slots of rank %d on %d layers (%.1f MiB)", lora.max_loras, lora.max_lora_rank,
                        len(self.lora.layers), self.lora.nbytes / 2**20)
        # A vision-language model's image embeddings, kept while requests need them.
        vlm = vision_language(self.model)
        self.images = ImageEmbeddings(vlm, self.device) if vlm is not None else None
        if vlm is not None and self.device.type == "cpu" and self.dtype == torch.float32 != self.weight_dtype:
            # The towers are plain torch modules: on a CPU that does its half
            # math in float32 (no AVX512-BF16 or AMX), a bf16 linear through
            # torch ran 4.6x slower than the same in float32 (AVX2 EPYC).
            for module in vlm.vision_modules():
                module.float()
            logger.info("vision tower in float32: this CPU's half-precision math is float32")
        # Decode-only steps run as one captured unit where they can: CUDA
        # graphs on a GPU, the native DecoderStack on a CPU.
        self.graph_runner: DecodeGraphRunner | NativeDecodeRunner | None = None
        # Speculating steps (a verification beside decodes) as one unit too: CUDA graphs only.
        self.verify_graph_runner: VerifyGraphRunner | None = None
        self.cpu_paths: CpuFastPaths | None = None
        self.cpu_dispatch = loaded.cpu_dispatch  # on a CPU, which paths it takes and why (cpu/dispatch.py)
        # A pooling model never decodes nor samples: no decode runner, no greedy screen.
        generates = self.pooler is None
        if loaded.cpu_dispatch is not None:
            self.cpu_paths = CpuFastPaths(self.model, self.pool, loaded.cpu_dispatch, self.weight_dtype, generates)
            self.graph_runner = self.cpu_paths.decode_runner
        elif config.cuda_graph and self.attention.supports_graphs and generates:
            capture = CudaGraphCapture()
            self.graph_runner = self.capture_decode_graphs(capture)
            self.capture_speculation_graphs(capture)  # one memory pool for all
        elif config.cuda_graph:
            logger.info("CUDA graphs off: the %s attention backend cannot replay", self.attention.name)
        self.previous = PreviousStepTokens(self.device)  # fills the next plan's placeholders
        # Greedy rows' argmax read from the LM head's own (half) outputs: on a
        # GPU the float32 copy of [rows, vocab] logits is a kernel and a
        # write of 4 bytes a logit per step, and the copy is exact. On a CPU
        # the native argmax reads float32, which the packed head writes directly.
        self.greedy_reads_head_dtype = self.device.type != "cpu"
        # What every rank holds (gathered from all of them; equal on every rank).
        self.tp_layout = gather_layout(self)
        pool_mib = self.pool.buffer.numel() * self.pool.buffer.element_size() / 2**20
        proposer = self.draft or self.eagle3
        if proposer is not None:
            logger.info("draft's KV pool: the same %d pages (%.0f MiB)", self.num_pages, proposer.pool_bytes / 2**20)
        logger.info("%s; KV pool: %d pages x %d = %d tokens (%.0f MiB%s)", describe(loaded), self.num_pages,
                    self.page_size, self.kv_capacity_tokens, pool_mib,
                    ", in 2 MiB pages" if self.pool.huge_pages else "")
        if self.tp.size > 1 and self.tp.is_leader:
            for line in layout_lines(self.tp_layout):
                logger.info("tensor parallel: %s", line)

    @property
    def greedy_screen(self) -> GreedyScreen | HeadArgmax | None:
        """Greedy rows' tokens without the sampler's full logits, on a CPU
        (a float32 head's screen, a half head's own argmax); None: off."""
        return self.cpu_paths.greedy_screen if self.cpu_paths is not None else None

    @greedy_screen.setter
    def greedy_screen(self, screen: GreedyScreen | HeadArgmax | None) -> None:  # tests and benchmarks turn it off
        if self.cpu_paths is not None:
            self.cpu_paths.greedy_screen = screen

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

    @property
    def output_width(self) -> int:
        """The model forward's row width: its hidden size, and with an
        EAGLE-3 head the three states the head reads after it."""
        aux = len(self.eagle3.aux_layers) if self.eagle3 is not None else 0
        return self.model_config.hidden_size * (1 + aux)

    def _graph_target(self, capture: Capture) -> GraphTarget:
        return GraphTarget(self.model, self.attention, self.output_width, self.dtype, self.device,
                           self._max_pages_per_request, capture)

    @property
    def _max_pages_per_request(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def _graph_max_bs(self) -> int:
        return min(self.config.cuda_graph_max_bs, self.config.max_running_requests)

    def capture_decode_graphs(self, capture: Capture) -> DecodeGraphRunner:
        """Capture the decode graphs (CUDA: after the pool exists, since they bake in its address)."""
        lora = (self.lora.state, self.lora.num_slots) if self.lora is not None else None
        return DecodeGraphRunner(self._graph_target(capture), self._graph_max_bs, lora)

    def capture_verify_graphs(self, capture: Capture) -> VerifyGraphRunner | None:
        """With speculative decoding: graphs for its verification steps, up to
        the batch size where speculation turns off (None without speculation,
        or where the attention backend cannot replay an extend)."""
        sizes = self._verify_sizes()
        if sizes is None or not self.attention.supports_verify_graphs:
            return None
        return VerifyGraphRunner(self._graph_target(capture), *sizes, self.page_size)

    def _verify_sizes(self) -> tuple[int, int] | None:
        """With speculative decoding, its verify graphs' largest batch (where
        speculation turns off, or the graphs' own limit) and rows a request
        (k + 1); None without."""
        speculative = resolve_speculative(self.config)
        if speculative is None:
            return None
        return min(speculative.disable_by_batch_size, self._graph_max_bs), speculative.num_tokens + 1

    def capture_speculation_graphs(self, capture: Capture) -> None:
        """The verify graphs and the proposer's graphs. Where a capture fails
        (a kernel or a shape the capture refuses), speculation runs those
        steps eagerly, slower but correct, and says why, rather than the
        server not starting."""
        try:
            self.verify_graph_runner = self.capture_verify_graphs(capture)
        except Exception:
            logger.exception("verify graphs not captured: speculative verifications run eagerly")
            self.verify_graph_runner = None
        proposer = self.draft or self.eagle3
        try:
            self.capture_draft_graphs(capture)
        except Exception:
            logger.exception("the proposer's graphs not captured: its decodes run eagerly")
            if proposer is not None:
                proposer.decode_graphs = proposer.verify_graphs = None

    def capture_draft_graphs(self, capture: Capture) -> None:
        """A draft model's or an EAGLE-3 head's graphs, at the target's sizes (nothing without either)."""
        sizes = self._verify_sizes()
        proposer = self.draft or self.eagle3
        if proposer is None or sizes is None:
            return
        proposer.capture_graphs(capture, self._graph_max_bs, self._max_pages_per_request, *sizes)

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
        if self.cpu_paths is not None and self.cpu_paths.upgrade():  # the one point the CPU paths change
            self.graph_runner = self.cpu_paths.decode_runner
        host_plan, plan = plan, plan.to(self.device)
        input_ids = self.previous.resolve(plan.step, plan.input_ids, host_plan.input_ids)
        draft_tokens = None
        proposer = self.draft or self.eagle3
        if proposer is not None and host_plan.draft is not None:
            # The proposals fill their rows before the target verifies them.
            draft_tokens, input_ids = proposer.propose(host_plan, input_ids)
        if self.draft is not None:
            self.draft.follow(plan, host_plan, input_ids)
        routing = None
        if self.lora is not None and host_plan.lora is not None:
            self.lora.apply_loads(host_plan.lora.loads)
            routing = self.lora.route(host_plan)  # also checks each slot holds its adapter
        image_embeds = None
        if host_plan.images is not None:
            if self.images is None:
                raise ValueError("a plan with images for a model that reads none")
            image_embeds = self.images.step(host_plan.images)
        # A captured step (a CUDA graph, the native DecoderStack) runs the
        # adapters from the plan itself; the modules read the routing.
        replay = replaying(host_plan, self.graph_runner, self.verify_graph_runner)
        if replay is not None:
            hidden = replay.run(input_ids, plan, host_plan)
        else:
            meta = self.attention.prepare(plan, host_plan)
            with self.lora.routed(routing) if self.lora is not None else nullcontext():
                if image_embeds is not None:
                    hidden = cast(VisionLanguageModel, self.model)(input_ids, plan.positions, meta, image_embeds)
                else:
                    hidden = self.model(input_ids, plan.positions, meta)
        aux = None
        if self.eagle3 is not None:  # [T, 4 x H]: the final states, then the head's three
            width = self.model_config.hidden_size
            hidden, aux = hidden[:, :width], hidden[:, width:]
        tokens = self._tokens(hidden[plan.logits_indices], plan, host_plan) if plan.sampling is not None else None
        if tokens is None:
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            tokens = SamplerOutput(empty, empty.float(), None, None)
        self.previous.record(plan.step, tokens.token_ids)
        if self.eagle3 is not None:
            assert aux is not None
            self.eagle3.follow(plan, host_plan, aux, tokens.token_ids)
        prompt: tuple[torch.Tensor | None, ...] = (None, None, None, None)
        if plan.prompt_logprobs is not None:
            logits = self.model.compute_logits(hidden[plan.prompt_logprobs.token_indices])
            if self.tp.is_leader:
                prompt = prompt_logprobs(logits, plan.prompt_logprobs.target_ids, plan.prompt_logprobs.num_top)
        output = StepOutput(tokens.token_ids, tokens.logprobs, tokens.top_ids, tokens.top_logprobs, *prompt)
        output.draft_tokens = draft_tokens
        if host_plan.pooling is not None:
            output.pooled, output.scores = pool_segments(hidden, host_plan.pooling, self.score_head, self.score_row)
        return output

    def _tokens(self, rows: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> SamplerOutput:
        """The sampled rows' tokens: by the greedy screen when it serves every
        row, else sampled from the full logits on the leader and broadcast."""
        st, screen = host_plan.sampling, self.greedy_screen
        raw_argmax = st is not None and st.takes_raw_argmax
        if screen is not None and raw_argmax:
            screened = screen.argmax(rows)
            if screened is not None:
                return SamplerOutput(screened, torch.zeros(screened.shape[0]), None, None)
        # The LM head gathers the vocabulary shards: every rank takes part.
        if raw_argmax and self.greedy_reads_head_dtype and self.model.logits_are_head_outputs:
            logits = self.model.head_outputs(rows)
        else:
            logits = self.model.compute_logits(rows)
        if self.tp.is_leader:
            sampled = sample(logits, self._resolved_sampling(plan, host_plan))
        else:
            empty = torch.zeros(0, device=self.device)
            sampled = SamplerOutput(torch.empty(logits.shape[0], dtype=torch.long, device=self.device), empty, None, None)
        broadcast_from_leader(sampled.token_ids)
        return sampled

    def _resolved_sampling(self, plan: BatchPlan, host_plan: BatchPlan) -> SamplingTensors:
        """The plan's sampling tensors with the last step's tokens in place of
        their placeholders (penalties read the tokens generated so far)."""
        st, host_st = plan.sampling, host_plan.sampling
        assert st is not None and host_st is not None
        if st.has_penalties:
            st.output_token_ids = self.previous.resolve(plan.step, st.output_token_ids, host_st.output_token_ids)
            st.seen_token_ids = self.previous.resolve(plan.step, st.seen_token_ids, host_st.seen_token_ids)
        return st
