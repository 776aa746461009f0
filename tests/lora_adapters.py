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
