"""Tiny PEFT LoRA adapters for the tests, written by `peft` itself.

Each is a real `save_pretrained` folder (adapter_config.json and
adapter_model.safetensors with PEFT's names), with random A and B (PEFT
starts B at zero; `init_lora_weights=False` draws both), seeded so every
run writes the same bytes, and scaled up so that an adapter changes
greedy outputs visibly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = 8
    alpha: float = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    seed: int = 1


def base_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def write_adapter(checkpoint: Path, folder: Path, spec: AdapterSpec, gain: float = 3.0) -> Path:
    """An adapter of `spec` for `checkpoint`, saved into `folder`."""
    from peft import LoraConfig, get_peft_model

    model = base_model(checkpoint)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern), init_lora_weights=False, lora_dropout=0.0, bias="none",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[-1] ** 0.5)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(checkpoint: Path, adapter: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """PEFT's own greedy tokens for `prompt_ids` under `adapter` (None: the base)."""
    from peft import PeftModel

    model = base_model(checkpoint)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def write_raw_adapter(checkpoint: Path, folder: Path, rank: int, seed: int, targets: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), scale: float = 1.0) -> Path:
    """A PEFT-layout adapter written without peft (the GPU machine has no peft;
    benchmarks/lora.py writes its adapters with it too): random A and B
    (B times `scale`) for `targets` of every layer of a Llama-shaped checkpoint."""
    import json

    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            fan_in, fan_out = shapes[target]
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) / rank**0.5 * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none"}))
    return folder
