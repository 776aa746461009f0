"""The architecture facts a model needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aioserve.tp.distributed import kv_heads_per_rank
from aioserve.layers.rotary import RopeScaling
from aioserve.models.encoder_config import EncoderConfig, encoder_config
from aioserve.models.moe_config import MoeConfig
from aioserve.models.special_tokens import special_token_id
from aioserve.models.text_of_multimodal import TEXT_MODEL_OF, text_model_config
from aioserve.models.vision_config import VisionConfig, gemma3_vision_config, vision_language_config
from aioserve.quant.config import read_quantization
from aioserve.quant.method import QuantMethod


# A decoder family's bare model (no LM head), as embedders are saved -> the
# class that serves it (its LM head, tied to the embedding, never used).
DECODER_OF_BACKBONE = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM",
}


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int  # positions the engine may use (an encoder's table has `position_offset` more rows)
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_windows: list[int | None]  # per layer; None = full attention
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoeConfig | None = None  # mixture-of-experts models only
    attention_scale: float = 0.0  # the softmax scale: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    # The sliding-window layers' own rope (Gemma 3: theta 10k, unscaled) where it differs from the global one.
    local_rope: tuple[float, RopeScaling] | None = None
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    hidden_act: str = "silu"
    quantization: QuantMethod | None = None  # quantised checkpoints only (quant/: FP8)
    # The architecture config.json names when it wraps this text model with a
    # vision tower (Gemma3ForConditionalGeneration): its weights carry prefixes.
    wrapper: str | None = None
    # Saved as the bare decoder (`Qwen3Model`: sentence-transformers' embedders):
    # its tensors lack the `model.` prefix and there is no LM head.
    backbone_only: bool = False
    encoder: EncoderConfig | None = None  # BERT and XLM-R: bidirectional, no LM head (models/bert.py)
    # A vision-language model served whole (Qwen2.5-VL): its tower's config
    # and the image tokens; None for a text model.
    vision: VisionConfig | None = None

    @property
    def is_encoder(self) -> bool:
        """Attention sees the whole sequence (AttentionShape.causal False) and
        there is no LM head: embeddings and sequence scores, not generation."""
        return self.encoder is not None

    @property
    def uses_mrope(self) -> bool:
        """Tokens have three rotary positions (time, height, width): a step
        with images passes [3, T] positions (image_inputs.mrope_positions)."""
        return self.rope_scaling.mrope_section is not None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        outer = (raw.get("architectures") or [None])[0]
        gemma3_vision = gemma3_vision_config(raw)  # a wrapper served whole: its text model and its tower
        raw = text_model_config(raw)
        raw, vision = vision_language_config(raw)
        vision = vision or gemma3_vision
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture")
        arch = archs[0]
        backbone_only = arch in DECODER_OF_BACKBONE
        if backbone_only:  # a decoder saved without its LM head (an embedder): the family's class, head tied
            arch, raw = DECODER_OF_BACKBONE[arch], {**raw, "tie_word_embeddings": True}
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        model_type = raw.get("model_type", "")
        theta, rope_scaling = _rope(raw, "full_attention")
        layered_rope = raw.get("rope_local_base_freq") is not None or "sliding_attention" in (
            raw.get("rope_parameters") or {}
        )
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        scalar = raw.get("query_pre_attn_scalar")
        encoder = encoder_config(raw)
        if raw.get("attn_logit_softcapping"):
            raise ValueError(f"{arch}: attention logit softcapping (attn_logit_softcapping) is not supported")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048) - (encoder.position_offset if encoder else 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            sliding_windows=_sliding_windows(raw, arch, num_layers),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            moe=MoeConfig.from_dict(raw, num_layers),
            # (compression_config: where early compressed-tensors checkpoints wrote it)
            quantization=read_quantization(raw.get("quantization_config") or raw.get("compression_config")),
            attention_scale=float(scalar or head_dim) ** -0.5,
            local_rope=_rope(raw, "sliding_attention") if layered_rope else None,
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            wrapper=outer if outer in TEXT_MODEL_OF else None,
            backbone_only=backbone_only,
            encoder=encoder,
            vision=vision,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        config = cls.from_dict(raw, generation)
        encoder = config.encoder
        if encoder is not None and encoder.sep_token_id is None and encoder.pair_token_types and encoder.type_vocab_size > 1:
            encoder.sep_token_id = special_token_id(path, "sep_token")  # BERT types a pair by it
        return config

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each tensor-parallel rank holds (replicated when there
        are fewer KV heads than ranks)."""
        return kv_heads_per_rank(self.num_kv_heads, tp_size)


def _rope(raw: dict[str, Any], layer_type: str) -> tuple[float, RopeScaling]:
    """(theta, scaling) of the rope for one layer type. Most models have one
    rope (`rope_parameters`, or the older `rope_theta` and `rope_scaling`);
    Gemma 3 has one per layer type: `rope_parameters` keyed by layer type,
    or in older configs `rope_theta` and `rope_scaling` for the global layers
    and `rope_local_base_freq`, unscaled, for the sliding ones."""
    parameters = raw.get("rope_parameters") or {}
    local = layer_type == "sliding_attention"
    if "full_attention" in parameters or "sliding_attention" in parameters:
        rope = parameters.get(layer_type) or {}
    elif local:
        rope = {}  # the older Gemma 3 form: no scaling on the sliding layers
    else:
        rope = parameters or raw.get("rope_scaling") or {}
    gemma3 = str(raw.get("model_type", "")).startswith("gemma3")
    default = (10000.0 if local else 1_000_000.0) if gemma3 else 10000.0  # transformers' defaults
    fallback = raw.get("rope_local_base_freq") if local else raw.get("rope_theta")
    theta = rope.get("rope_theta") or fallback or default
    kind = rope.get("rope_type") or rope.get("type") or "default"
    params = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta", "mrope_section")}
    # M-RoPE (Qwen2.5-VL): older configs name the type "mrope", transformers 5
    # "default" beside the section; either way the frequencies are plain ones.
    section = rope.get("mrope_section")
    if kind == "mrope":
        kind = "default"
    if params.get("mrope_interleaved"):
        raise ValueError("interleaved M-RoPE (mrope_interleaved: Qwen3-VL) is not supported")
    params.pop("mrope_interleaved", None)
    return float(theta), RopeScaling(kind, params, tuple(section) if section else None)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """EOS ids of config.json and generation_config.json together (Qwen
    lists <|im_end|> in one and <|endoftext|> in the other)."""
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        ids += [i for i in _as_list(value) if i not in ids]
    return ids


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> list[int | None]:
    """Which layers attend only to the last `sliding_window` tokens.

    Mistral applies its window (when set) to every layer; Qwen2/Qwen3 only
    when `use_sliding_window` is on, and then from layer `max_window_layers`
    up, as Hugging Face does. `layer_types`, when present, is authoritative.
    """
    window = raw.get("sliding_window")
    if not window:
        return [None] * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if str(raw.get("model_type", "")).startswith("gemma3"):
        # Older Gemma 3 configs: every `sliding_window_pattern`-th layer is global.
        pattern = raw.get("sliding_window_pattern") or 6
        return [window if (i + 1) % pattern else None for i in range(num_layers)]
    if arch.startswith("Qwen"):
        if not raw.get("use_sliding_window", False):
            return [None] * num_layers
        first = raw.get("max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers
