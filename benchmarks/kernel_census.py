"""How many kernels a GPU step launches, counted on a CPU.

At batch 1 a GPU decode step is bound by kernel launches, not by bandwidth
(the H100 step of Qwen3-0.6B took 1.83 ms of GPU time for 0.41 ms of weight
reads), so the number of kernels per decoder layer is the figure to cut. This
runs one decode step and one prefill chunk of the CUDA code path on CPU:
bfloat16, dummy weights, FlashInfer's attention and fused ops through the
enforcing fake (tests/fake_flashinfer.py), the decode through the graph
runner's code path (captured eagerly), plain F.linear matmuls (what the
layers call on CUDA), the CPU's native kernels and packed weights off. Every
aten op that would launch a CUDA kernel is counted (views, reshapes and
allocations launch none), and each FlashInfer call counts as one kernel; ops
that read a device value back to the host (`.item()`) are listed apart,
since on a GPU they also stall the step.

Counts are per decoder layer (every layer of a model launches the same
kernels; layer 0 is shown, and the others are checked equal), for the
embedding, the final norm, the LM head and the sampler, and the rest of the
step (placing plan tensors, the graph's input copies). A model is built
with two decoder layers and its real widths: the counts per layer do not
depend on the depth.

    python benchmarks/kernel_census.py                      # every model, decode at batch 1 and a prefill chunk
    python benchmarks/kernel_census.py --model qwen3-0.6b --batch 1 16 --ops   # ... and each op by name
    python benchmarks/kernel_census.py --json census.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the enforcing FlashInfer fake lives with the tests

from fake_flashinfer import fake_flashinfer, fake_gate_up_silu, fake_qk_rope_store  # noqa: E402
from roofline import decode_plan  # noqa: E402  (a sibling script: the same decode-only plan)

from aioserve.attention.flashinfer import FlashInferBackend  # noqa: E402
from aioserve.batch_plan import BatchPlan  # noqa: E402
from aioserve.config import EngineConfig  # noqa: E402
from aioserve.cpu import elementwise as native_elementwise  # noqa: E402
from aioserve.engine.cuda_graph import EagerCapture  # noqa: E402
from aioserve.engine import engine as engine_module  # noqa: E402
from aioserve.engine.engine import Engine  # noqa: E402
from aioserve.flashinfer import elementwise as flashinfer_elementwise  # noqa: E402
from aioserve.flashinfer import loader as flashinfer_loader  # noqa: E402
from aioserve.flashinfer import gate_up_silu, qk_rope_store  # noqa: E402
from aioserve.layers import linear as linear_module  # noqa: E402
from aioserve.sampling_params import SamplingParams  # noqa: E402
from aioserve.scheduler.request import Request  # noqa: E402
from aioserve.scheduler.sampling_batch import SampleRow, SamplingBatchBuilder  # noqa: E402

logger = logging.getLogger("benchmarks.kernel_census")

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128009,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "sliding_window": 512, "query_pre_attn_scalar": 256,
    "layer_types": ["sliding_attention", "full_attention"], "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
QWEN3_MOE = {  # Qwen3-30B-A3B's layer: 128 experts of 768, top-8
    **QWEN3_06B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "intermediate_size": 6144, "tie_word_embeddings": False,
}
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_06B, "llama-3-8b": LLAMA3_8B, "gemma-3-1b": GEMMA3_1B, "qwen3-moe": QWEN3_MOE,
}
LAYERS = 2  # decoder layers built: enough to check that layers launch alike

# aten ops that launch no kernel: views and metadata, and allocations
# (the caching allocator hands out memory without a kernel).
NO_KERNEL = {
    "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "permute", "expand", "as_strided",
    "slice", "select", "unsqueeze", "squeeze", "narrow", "split", "split_with_sizes", "unbind", "chunk", "alias",
    "detach", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "sym_size",
    "sym_stride", "sym_numel", "is_nonzero", "_to_copy_noop", "view_as_real", "view_as_complex", "unflatten",
    "flatten", "movedim", "diagonal", "contiguous_noop", "set_", "resize_", "as_strided_",
}
# `.to()` and `.contiguous()` that change nothing return their input, and launch nothing.
RETURNS_SELF_WHEN_NOOP = {"to", "contiguous"}
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "tolist"}  # a device value the host waits for


@dataclass
class Section:
    """One part of a step: its kernels by op name, and its host reads."""

    kernels: Counter = field(default_factory=Counter)
    host_reads: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


@dataclass
class StepCensus:
    model: str
    step: str  # "decode bs=N" or "prefill N tokens"
    per_layer: int
    layers_equal: bool
    sections: dict[str, Section]
    fused: dict[str, dict[str, object]]
    uploads: int  # plan tensors copied to the device

    @property
    def host_reads(self) -> int:
        return sum(sum(s.host_reads.values()) for s in self.sections.values())

    def row(self) -> dict[str, object]:
        return {"model": self.model, "step": self.step, "per_layer": self.per_layer,
                **{name: s.total for name, s in self.sections.items() if not name.startswith("layer ")},
                "host_reads": self.host_reads, "uploads": self.uploads}


class KernelCounter(TorchDispatchMode):
    """Counts each kernel-launching aten op into the section open when it runs;
    a FlashInfer call counts once and its torch rendering not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, Section] = {}
        self.scope = ["step"]
        self.inside_flashinfer = 0
        self.active = False  # FlashInfer calls count only while the mode is on
        # Tensors on the host of a GPU run (the plan as the scheduler built it,
        # and what is computed from it alone): ops on them launch nothing.
        # By id, held alive for the step (a WeakSet compares tensors by value).
        self.host: dict[int, torch.Tensor] = {}
        self.uploads = 0  # plan tensors copied to the device (copies, not kernels; launches all the same)

    def section(self) -> Section:
        return self.sections.setdefault(self.scope[-1], Section())

    def __enter__(self) -> KernelCounter:
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        if inputs and all(id(t) in self.host for t in inputs):  # host work on a GPU too: no kernel
            self.host.update((id(t), t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out
        name = func.overloadpacket.__name__.rstrip("_")
        if not self.inside_flashinfer:
            if name in HOST_READS:
                self.section().host_reads[name] += 1
            elif name not in NO_KERNEL and not (name in RETURNS_SELF_WHEN_NOOP and args and out is args[0]):
                self.section().kernels[name] += 1
        return out

    def mark_host(self, plan: object) -> None:
        """Every tensor of `plan` (nested dataclasses too) stays on the host."""
        if isinstance(plan, torch.Tensor):
            self.host[id(plan)] = plan
        elif is_dataclass(plan) and not isinstance(plan, type):
            for f in fields(plan):
                self.mark_host(getattr(plan, f.name))

    @contextmanager
    def scoped(self, name: str) -> Iterator[None]:
        self.scope.append(name)
        try:
            yield
        finally:
            self.scope.pop()

    def flashinfer_call(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        return self.kernel_call(f"flashinfer.{name}", call)

    def kernel_call(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` counted as one kernel named `name` (what it runs on CPU is not counted)."""
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active and not self.inside_flashinfer:
                self.section().kernels[name] += 1
            self.inside_flashinfer += 1
            try:
                return call(*args, **kwargs)
            finally:
                self.inside_flashinfer -= 1
        return counted


# -- the FlashInfer fake, counted ---------------------------------------------------------------

def counted_flashinfer(counter: KernelCounter) -> Any:
    """fake_flashinfer with each kernel entry point counted once per call: the
    fused ops and the wrappers' `run` (planning is host work on a GPU too)."""
    from types import SimpleNamespace

    def wrap_module(module: Any, prefix: str) -> Any:
        members = {n: getattr(module, n) for n in dir(module) if not n.startswith("_")}
        return SimpleNamespace(**{
            n: counter.flashinfer_call(f"{prefix}.{n}", v) if callable(v) and not isinstance(v, type) else v
            for n, v in members.items()
        })

    def wrap_wrapper(cls: type, name: str) -> type:
        class Counted(cls):  # type: ignore[misc, valid-type]
            def run(self, *args: Any, **kwargs: Any) -> Any:
                return counter.flashinfer_call(name, super().run)(*args, **kwargs)
        Counted.__name__ = cls.__name__
        return Counted

    fake = fake_flashinfer
    namespace = {n: getattr(fake, n) for n in dir(fake) if not n.startswith("_")}
    for module in ("norm", "rope", "activation", "sampling", "fused_moe", "page"):
        if module in namespace:
            namespace[module] = wrap_module(namespace[module], module)
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        if name in namespace:
            short = "decode" if "Decode" in name else "prefill"
            namespace[name] = wrap_wrapper(namespace[name], f"attention.{short}")
    return SimpleNamespace(**namespace)


@contextmanager
def cuda_code_path(counter: KernelCounter) -> Iterator[Any]:
    """The layers' CUDA choices taken on CPU tensors: FlashInfer's fused ops
    through the counted fake, plain F.linear for every matmul, no native kernels."""
    fake = counted_flashinfer(counter)
    modules = (flashinfer_loader.FLASHINFER, qk_rope_store.KERNEL, gate_up_silu.KERNEL)
    saved = (native_elementwise.ENABLED, flashinfer_elementwise.DEVICE_TYPES, linear_module.cpu_matmul,
             [(m.module, m.tried) for m in modules])
    native_elementwise.ENABLED = False
    flashinfer_elementwise.DEVICE_TYPES = ("cuda", "cpu")
    # FlashInfer, and aioserve's own Triton kernels: their stand-ins, each call counted as one kernel.
    own = SimpleNamespace(qk_rope_store=counter.kernel_call("aioserve.qk_rope_store", fake_qk_rope_store.qk_rope_store))
    own_mlp = SimpleNamespace(gate_up_silu=counter.kernel_call("aioserve.gate_up_silu", fake_gate_up_silu.gate_up_silu))
    for module, stand_in in zip(modules, (fake, own, own_mlp)):
        module.module, module.tried = stand_in, True
    linear_module.cpu_matmul = lambda x, w, choice, bias=None, float_out=False, out=None: F.linear(x, w, bias)
    flashinfer_elementwise.forget_decisions()
    try:
        yield fake
    finally:
        flashinfer_elementwise.forget_decisions()  # decided for CPU tensors: nobody else's
        native_elementwise.ENABLED, flashinfer_elementwise.DEVICE_TYPES, linear_module.cpu_matmul, states = saved
        for module, (held, tried) in zip(modules, states):
            module.module, module.tried = held, tried


# -- the engine and its steps ------------------------------------------------------------------

class NoCpuFastPaths:
    """In place of the engine's CpuFastPaths: no packed weights, native decode
    stack or greedy screen (they are the CPU's, not the GPU's path)."""

    decode_runner = None
    greedy_screen = None

    def __init__(self, *args: object) -> None:
        pass

    def upgrade(self) -> bool:
        return False


def build_engine(name: str, folder: Path, fake: Any) -> Engine:
    config = {**MODELS[name], "num_hidden_layers": LAYERS}
    (folder / "config.json").write_text(json.dumps(config))
    cpu_paths, engine_module.CpuFastPaths = engine_module.CpuFastPaths, NoCpuFastPaths
    try:
        engine = Engine(EngineConfig(
            model=str(folder), load_format="dummy", dtype="bfloat16", cpu_half_compute="native", device="cpu",
            num_pages=128, page_size=16, max_model_len=1024, cpu_matmul_tuning=False,
            attention_backend="torch_native", cuda_graph_max_bs=16,
        ))
    finally:
        engine_module.CpuFastPaths = cpu_paths
    engine.cpu_paths = None
    engine.greedy_reads_head_dtype = True  # as on a GPU
    engine.attention = FlashInferBackend(engine.pool, engine.attention_shape, fake)
    engine.graph_runner = engine.capture_decode_graphs(EagerCapture())
    return engine


def _rows(n: int) -> list[SampleRow]:
    return [SampleRow(Request(f"r{i}", [1], SamplingParams(temperature=0), lambda e: None), 0, None)
            for i in range(n)]


def prefill_plan(engine: Engine, tokens: int, sampling: SamplingBatchBuilder) -> BatchPlan:
    """One request's first chunk of `tokens` tokens, sampling its last."""
    width = -(-tokens // engine.page_size)
    pages = (torch.arange(width) + 1).view(1, width)
    positions = torch.arange(tokens)
    return BatchPlan(
        step=0, input_ids=torch.full((tokens,), 1, dtype=torch.long), positions=positions,
        out_cache_loc=pages[0].repeat_interleave(engine.page_size)[:tokens].long() * engine.page_size
        + positions % engine.page_size,
        seq_lens=torch.tensor([tokens]), extend_lens=torch.tensor([tokens]), page_table=pages.int(),
        num_decodes=0, logits_indices=torch.tensor([tokens - 1]), sampling=sampling.build(_rows(1)),
    )


@contextmanager
def sections_of(engine: Engine, counter: KernelCounter) -> Iterator[None]:
    """Route the counts: each decoder layer, embedding, final norm, head, sampler."""
    model = engine.model
    hooks = []

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: counter.scope.append(name)

    def leave(module: Any, args: Any, output: Any) -> None:
        counter.scope.pop()

    parts = {f"layer {i}": layer for i, layer in enumerate(model.decoder_layers())}
    parts.update({"embedding": model.embed_tokens, "final norm": model.final_norm})
    for name, module in parts.items():
        hooks += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]

    def scoped(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            with counter.scoped(name):
                return call(*args)
        return counted

    model.compute_logits = scoped("lm head", model.compute_logits)  # type: ignore[method-assign]
    model.head_outputs = scoped("lm head", model.head_outputs)  # type: ignore[method-assign]
    engine._tokens = scoped("sampler", engine._tokens)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        del model.compute_logits, model.head_outputs, engine._tokens


@contextmanager
def uploads_counted(counter: KernelCounter) -> Iterator[None]:
    """`plan.to(device)` as on a GPU: the host plan's tensors stay host
    tensors, the device plan gets copies of its own (counted as uploads)."""
    original = BatchPlan.to

    def to(plan: BatchPlan, device: torch.device) -> BatchPlan:
        counter.mark_host(plan)
        active, counter.active = counter.active, False
        with torch.utils._python_dispatch._disable_current_modes():
            moved = copy.deepcopy(plan)
        counter.active = active
        counter.uploads += sum(1 for f in fields(moved) if isinstance(getattr(moved, f.name), torch.Tensor)
                               and getattr(moved, f.name).numel())
        return moved

    BatchPlan.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        BatchPlan.to = original  # type: ignore[method-assign]


def census(engine: Engine, name: str, step: str, plan: BatchPlan, counter: KernelCounter) -> StepCensus:
    engine.launch(plan)  # once uncounted: first-call work (buffers, plans) is not per step
    counter.sections, counter.uploads, counter.host = {}, 0, {}
    with sections_of(engine, counter), uploads_counted(counter), counter:
        engine.launch(plan)
    layers = [counter.sections.get(f"layer {i}", Section()) for i in range(LAYERS)]
    # Layer 1 stands for every layer but the first, which has no residual
    # to add yet (a plain RMSNorm where the others fuse the add): the same count.
    order = ["embedding", "layer 1", "final norm", "lm head", "sampler", "step"]
    sections = {key: counter.sections.get(key, Section()) for key in order}
    return StepCensus(name, step, layers[1].total, all(layer.total == layers[1].total for layer in layers),
                      sections, flashinfer_elementwise.report(), counter.uploads)


def run(models: list[str], batches: list[int], prefill_tokens: int) -> list[StepCensus]:
    results = []
    counter = KernelCounter()
    with cuda_code_path(counter) as fake, tempfile.TemporaryDirectory() as tmp:
        for name in models:
            folder = Path(tmp, name)
            folder.mkdir()
            engine = build_engine(name, folder, fake)
            sampling = SamplingBatchBuilder(engine.vocab_size, engine.model_config.eos_token_ids, 0)
            for batch in batches:
                plan = decode_plan(engine, batch, 64, sampling)
                results.append(census(engine, name, f"decode bs={batch}", plan, counter))
            if prefill_tokens:
                plan = prefill_plan(engine, prefill_tokens, sampling)
                results.append(census(engine, name, f"prefill {prefill_tokens}", plan, counter))
            del engine
    return results


def print_tables(results: list[StepCensus], ops: bool) -> None:
    header = f"{'model':<12} {'step':<14} {'per layer':>9} {'embed':>6} {'norm':>5} {'head':>5} {'sampler':>7} " \
             f"{'other':>6} {'host reads':>10} {'uploads':>8}"
    print(header)
    for r in results:
        s = r.sections
        flag = "" if r.layers_equal else "  (layers differ!)"
        print(f"{r.model:<12} {r.step:<14} {r.per_layer:>9} {s['embedding'].total:>6} {s['final norm'].total:>5} "
              f"{s['lm head'].total:>5} {s['sampler'].total:>7} {s['step'].total:>6} {r.host_reads:>10} "
              f"{r.uploads:>8}{flag}")
    if ops:
        for r in results:
            print(f"\n{r.model}, {r.step}:")
            for key, section in r.sections.items():
                listed = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(section.kernels.items()))
                reads = ", ".join(f"{op} x{n}" for op, n in section.host_reads.items())
                print(f"  {key:<11} {section.total:>3}: {listed}" + (f"  | host reads: {reads}" if reads else ""))
        print("\nfused ops (FlashInfer): taken, or why not")
        for op, state in results[-1].fused.items():
            print(f"  {op}: fused={state['fused']} fell back: {state['fell_back'] or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--prefill", type=int, default=64, help="tokens of the prefill chunk (0: none)")
    parser.add_argument("--ops", action="store_true", help="list each section's kernels by name")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    results = run(args.model, args.batch, args.prefill)
    print_tables(results, args.ops)
    if args.json:
        Path(args.json).write_text(json.dumps([
            {**r.row(), "ops": {k: dict(s.kernels) for k, s in r.sections.items()}} for r in results
        ], indent=2))


if __name__ == "__main__":
    main()
