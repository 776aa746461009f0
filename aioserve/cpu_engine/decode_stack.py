"""A CPU decode step as one native call: the CPU's counterpart of a CUDA graph.

A small model's CPU decode step is bound by the Python between its kernels:
tiny-llama at batch 1 spent 2.1 ms of a 3.4 ms step in its matmuls and most
of the rest in ~70 calls through modules, views and bindings. For the Llama
family, `DecoderStack` (native/decoder.cpp) runs those same kernels in the
same order on the same tensors, embedded tokens to final norm, so a
decode-only step gets bit-identical hidden states in one call. Like the CUDA
graph runner it serves decode-only steps and hands the engine the hidden
states; the LM head and sampling stay in Python. Everything else (prefill,
mixed steps, prompt logprobs) runs the modules.

It is built only where it is exact: every matmul packed for the native
kernel, the native elementwise kernels on, one rank (no all-reduce between
layers), and a model whose layers are exactly Llama's, Qwen2's or Qwen3's.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Protocol

import torch

from aioserve.batch_plan import BatchPlan, token_rows
from aioserve.tp.distributed import get_tp_group
from aioserve.kvcache.kv_pool import KVPool
from aioserve.cpu.elementwise import elementwise_kernels
from aioserve.models.causal_lm import CausalLM
# The one place outside models/ that names a family: DecoderStack reproduces
# Llama's layers kernel for kernel, so it reads their concrete layout.
from aioserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from aioserve.models.qwen2 import Qwen2Attention
from aioserve.models.qwen3 import Qwen3Attention

logger = logging.getLogger(__name__)

# Attention classes whose math DecoderStack reproduces; a subclass that
# changes it must not be run by it, so this is a list, not an isinstance.
SUPPORTED_ATTENTION = (LlamaAttention, Qwen2Attention, Qwen3Attention)


def unsupported_reason(model: CausalLM, device: torch.device) -> str | None:
    """Why the native decode step cannot run this model here, or None."""
    if device.type != "cpu":
        return "not on a CPU"
    if get_tp_group().size > 1:
        return "tensor parallel (the layers all-reduce between kernels)"
    if elementwise_kernels() is None:
        return "the native kernels are not in (building, or turned off)"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    for layer in model.model.decoder_layers():
        if type(layer.self_attn) not in SUPPORTED_ATTENTION:
            return f"{type(layer.self_attn).__name__} is not a supported attention"
        if type(layer.mlp) is not LlamaMLP:
            return f"{type(layer.mlp).__name__} is not a dense MLP (mixture of experts)"
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(getattr(m.matmul_choice, "packed_features", None) is None for m in linears):
            return "the weights are not packed for the native matmul"
        if layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
            return "output projections with a bias"
    return None


class DecoderStack(Protocol):
    """What the engine calls on native/decoder.cpp's DecoderStack."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                page_table: torch.Tensor, seq_lens: torch.Tensor, row_slots: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor: ...

    def set_lora(self, layer: int, projection: str, slots: Any) -> None: ...  # native_gemm.LoraPointers


def build_decoder_stack(model: LlamaForCausalLM, pool: KVPool, kernels: ModuleType) -> DecoderStack:
    """A native/decoder.cpp DecoderStack over the model's own (packed) weights
    and the pool's caches."""
    config = model.config
    rotary = model.model.rotary
    first = model.model.decoder_layers()[0].self_attn
    stack = kernels.DecoderStack(
        num_heads=first.qkv_proj.num_heads,
        num_kv_heads=first.qkv_proj.num_kv_heads,
        head_dim=first.head_dim,
        eps=model.model.norm.eps,
        scale=first.scale,
        cos_cache=rotary.cos_cache,
        sin_cache=rotary.sin_cache,
        page_size=pool.page_size,
        final_norm=model.model.norm.weight,
    )
    for i, layer in enumerate(model.model.decoder_layers()):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, LlamaMLP)  # unsupported_reason refuses experts
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight) if isinstance(attn, Qwen3Attention) else (None, None)
        stack.add_layer(
            input_norm=layer.input_layernorm.weight,
            qkv=attn.qkv_proj.weight,
            qkv_bias=attn.qkv_proj.bias,
            q_norm=qk_norms[0],
            k_norm=qk_norms[1],
            o=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=mlp.gate_up_proj.weight,
            intermediate=config.intermediate_size,
            down=mlp.down_proj.weight,
            key_cache=pool.keys(i),
            value_cache=pool.values(i),
            window=attn.sliding_window or 0,
        )
    return stack


class NativeDecodeRunner:
    """Runs decode-only steps through a DecoderStack (the engine's
    `graph_runner` on CPU: same `can_run` / `run` as the CUDA one)."""

    def __init__(self, model: CausalLM, pool: KVPool, kernels: ModuleType) -> None:
        assert isinstance(model, LlamaForCausalLM)  # unsupported_reason refuses any other family
        self.model = model
        self.stack = build_decoder_stack(model, pool, kernels)
        self.replays = 0  # decode steps it ran (the CUDA runner's name for the same count)
        self.lora_bound = False  # the stack holds the layers' LoRA slots (their native copies)

    def _bind_lora(self) -> bool:
        """Hand the stack every projection's LoRA slots (once: their native
        copies are rewritten in place); False while they are not made yet."""
        if self.lora_bound:
            return True
        bindings = []
        for i, layer in enumerate(self.model.model.decoder_layers()):
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(mlp, LlamaMLP)  # unsupported_reason refuses experts
            for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                if linear.lora is None or linear.lora.native is None:
                    return False
                bindings.append((i, name, linear))
        for i, name, linear in bindings:
            slots = linear.lora
            assert slots is not None and slots.native is not None
            self.stack.set_lora(i, name, slots.native.pointers)
        self.lora_bound = True
        return True

    def can_run(self, host_plan: BatchPlan) -> bool:
        # The elementwise switch is read at every call (the modules honor it
        # mid-run too), and this runs nothing but native kernels. A step of
        # decodes and verified drafts runs too: each token as a decode.
        return (
            host_plan.prompt_logprobs is None
            and not host_plan.has_image_rows
            and (host_plan.lora is None or not host_plan.lora.uses_adapters or self._bind_lora())
            and elementwise_kernels() is not None
            and (host_plan.is_decode_only or host_plan.runs_as_decodes())
        )

    def run(self, input_ids: torch.Tensor, plan: BatchPlan, host_plan: BatchPlan) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens ([T, 4 x hidden]
        with an EAGLE-3 head's three states after them)."""
        n = host_plan.num_requests
        hidden = self.model.model.embed_tokens(input_ids).contiguous()
        self.replays += 1
        lora = host_plan.lora
        request_slots = lora.request_slots if lora is not None and lora.uses_adapters else None
        # An EAGLE-3 head's states come after the final ones, as the modules return them.
        aux = self.model.model.aux_layers
        if host_plan.is_decode_only:
            return self.stack.forward(hidden, plan.positions, plan.out_cache_loc, plan.page_table[:n],
                                      plan.seq_lens[:n], request_slots, aux)
        owners, lengths = token_rows(host_plan.seq_lens.tolist(), host_plan.extend_lens.tolist())
        rows = torch.tensor(owners, dtype=torch.long)
        page_table = plan.page_table[rows]
        seq_lens = torch.tensor(lengths, dtype=plan.seq_lens.dtype)
        row_slots = request_slots[rows] if request_slots is not None else None
        return self.stack.forward(hidden, plan.positions, plan.out_cache_loc, page_table, seq_lens, row_slots, aux)
