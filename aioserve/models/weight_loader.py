"""Build a model and fill its weights: from safetensors files, or random
("dummy") weights of the real shapes for benchmarks without a checkpoint.

Each checkpoint tensor is handed to the layer that owns it, which cuts its
tensor-parallel shard and fuses q/k/v and gate/up in place. The layer gets a
`CheckpointTensor`, not the tensor: indexing it reads only the rows or
columns asked for from the memory-mapped file, so a rank never holds a full
copy of a sharded weight.

A quantised checkpoint's format (ModelConfig.quantization, a QuantMethod of
quant/) is asked at each step: which layers hold quantised weights, which
tensors are read with their weight, how a weight loads. Nothing here knows
a format.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from aioserve.layers.linear import QuantizableLinear
from aioserve.layers.moe import DOWN, GATE, UP
from aioserve.tp.distributed import get_tp_group
from aioserve.models.causal_lm import CausalLM
from aioserve.models.model_config import ModelConfig
from aioserve.models.registry import model_class
from aioserve.models.text_of_multimodal import text_weight_name, vision_weight_name
from aioserve.quant.method import LazyTensor, QuantMethod

logger = logging.getLogger(__name__)

# Hugging Face projection name -> (our fused module, which part of it).
_FUSED_PARTS: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# An expert's projection (Qwen3-MoE's names, Mixtral's w1/w3/w2) -> our
# stacked parameter of `experts` and the part it fills.
_EXPERT_PARTS: dict[str, tuple[str, int]] = {
    "gate_proj": ("w13", GATE), "up_proj": ("w13", UP), "down_proj": ("w2", DOWN),
    "w1": ("w13", GATE), "w3": ("w13", UP), "w2": ("w2", DOWN),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
}


class CheckpointTensor:
    """A tensor of a safetensors file, not read yet: its shape, and indexing
    (`t[a:b]`, `t[:, a:b]`, `t[:]` for all of it) that reads just that part."""

    def __init__(self, handle: Any, name: str) -> None:  # a safetensors safe_open handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype(), torch.float64)  # unknown: as wide as any

    def __getitem__(self, index: object) -> torch.Tensor:
        return self._slice[index]


class _LoadsWeights(Protocol):
    """A layer that copies a checkpoint tensor (or a CheckpointTensor) into its parameter."""

    def load_weight(self, name: str, loaded: Any, shard: object = None) -> None: ...


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those the index names, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _target(model: nn.Module, hf_name: str) -> tuple[nn.Module, str, object] | None:
    """The module, parameter name and fused part a checkpoint tensor loads into."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    *module_path, param = hf_name.split(".")
    renames = getattr(model, "hf_module_renames", {})
    module_path = [renames.get(part, part) for part in module_path]
    shard: object = None
    if len(module_path) >= 3 and module_path[-3] == "experts" and module_path[-2].isdigit():
        # experts.<e>.<projection>.weight -> experts.<w13|w2>, shard (e, part)
        stacked, part = _EXPERT_PARTS.get(module_path[-1], (None, 0))
        if stacked is None or param != "weight":
            return None
        shard = (int(module_path[-2]), part)
        module_path, param = module_path[:-2], stacked
    elif module_path and module_path[-1] in _FUSED_PARTS:
        fused, fused_part = _FUSED_PARTS[module_path[-1]]
        # Fused only where the model fuses it: a vision tower keeps its
        # projections as the checkpoint names them (plain torch modules).
        with contextlib.suppress(AttributeError):
            return model.get_submodule(".".join([*module_path[:-1], fused])), param, fused_part
    try:
        return model.get_submodule(".".join(module_path)), param, shard
    except AttributeError:
        return None


def _local_name(model: nn.Module, config: ModelConfig, hf_name: str) -> str | None:
    """The name a checkpoint tensor loads under: a wrapped text model's
    prefix dropped, a bare decoder's added, and an encoder's own mapping (EncoderLM.checkpoint_name:
    its task prefix, its fused q/k/v); None for a tensor the model does not use."""
    name: str | None = hf_name
    if config.wrapper:  # a wrapper's text model, and its tower where it is served whole
        name = text_weight_name(hf_name) or (vision_weight_name(hf_name) if config.vision is not None else None)
    if config.backbone_only and name is not None and not name.startswith("model."):
        name = f"model.{name}"  # a bare decoder's tensors (an embedder), as its LM class names them
    rename = getattr(model, "checkpoint_name", None)
    if name is not None and rename is not None:
        name = rename(name)
    return name


def checkpoint_target(model: nn.Module, config: ModelConfig, hf_name: str) -> tuple[nn.Module, str, object] | None:
    """Where a tensor of this checkpoint's naming loads: the module, its
    parameter and the fused part (None: the model has no such tensor). A
    LoRA adapter's tensors name their layers the same way."""
    name = _local_name(model, config, hf_name)
    return _target(model, name) if name is not None else None


def load_safetensors(model: nn.Module, config: ModelConfig, path: Path) -> set[torch.dtype]:
    """Load every checkpoint tensor into its parameter; returns the dtypes
    the checkpoint stores them in (a quantised weight counts as the float32 it is
    dequantised to)."""
    method = config.quantization
    loaded: dict[int, set[object]] = {}  # id(parameter) -> the fused parts loaded into it
    stored: set[torch.dtype] = set()
    skipped = 0
    files = safetensors_files(path)
    quiet = len(files) < 2 or not get_tp_group().is_leader  # one bar, on rank 0
    with contextlib.ExitStack() as stack:
        # Every shard open at once: a quantised weight's scale may sit in another one.
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        owner = {name: handle for handle in handles for name in handle.keys()}
        for handle in tqdm(handles, desc="loading weights", unit="file", disable=quiet):
            for hf_name in handle.keys():
                name = _local_name(model, config, hf_name)
                if name is None:
                    skipped += 1  # the vision tower of a wrapped text model, an encoder's unused head
                    continue
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # tied: the embedding is the head
                if method is not None and method.reads_with_weight(name):
                    continue  # a scale, read with its weight (or one not used)
                target = _target(model, name)
                if target is None:
                    logger.warning("ignoring checkpoint tensor %s", hf_name)
                    continue
                module, param, shard = target
                if param == "weight" and method is not None and isinstance(module, QuantizableLinear) \
                        and module.quant is not None:
                    stored.add(method.load_held(module, CheckpointTensor(handle, hf_name), owner, shard))
                    loaded.setdefault(id(getattr(module, "weight_scale")), set()).add(shard)
                else:
                    tensor = _checkpoint_tensor(handle, hf_name, owner, method)
                    stored.add(tensor.dtype)
                    if hasattr(module, "load_weight"):
                        cast(_LoadsWeights, module).load_weight(param, tensor, shard)
                    else:
                        _load_whole(module, param, tensor, hf_name)
                loaded.setdefault(id(getattr(module, param)), set()).add(shard)
    if skipped and config.wrapper:
        logger.info("%s: serving the text model; %d vision tensors not loaded", config.wrapper, skipped)
    elif skipped:
        logger.info("%s: %d checkpoint tensors not used (a head it does not apply)", config.architecture, skipped)
    _check_complete(model, loaded, path)
    return stored


def _load_whole(module: nn.Module, param: str, loaded: LazyTensor, hf_name: str) -> None:
    """A plain torch module (nn.Linear, nn.Conv3d of a vision tower): its
    parameter takes the whole tensor on every rank (replicated, unsharded)."""
    target = getattr(module, param, None)
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"{hf_name}: {type(module).__name__} has no parameter {param!r}")
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"{hf_name}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(loaded[:])


def _checkpoint_tensor(handle: Any, hf_name: str, owner: dict[str, Any], method: QuantMethod | None) -> LazyTensor:
    """The lazy tensor a layer loads from; a quantised weight dequantised as it is read."""
    tensor = CheckpointTensor(handle, hf_name)
    if method is not None:
        return method.as_wide(tensor, owner)
    if tensor.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{hf_name} is stored in FP8 but config.json has no FP8 quantization_config")
    return tensor


def quantised_layers(model: nn.Module, config: ModelConfig, method: QuantMethod, path: Path) -> set[int]:
    """The ids of the modules at least one of whose checkpoint weights is
    stored quantised (the safetensors headers only): the layers a checkpoint's
    `ignore` list left wide are not among them."""
    layers: set[int] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for hf_name in handle.keys():
                name = _local_name(model, config, hf_name)
                if name is None or not method.stores_quantised(handle.get_slice(hf_name).get_dtype()):
                    continue
                target = _target(model, name)
                if target is not None:
                    layers.add(id(target[0]))
    return layers


def _check_complete(model: nn.Module, loaded: dict[int, set[object]], path: Path) -> None:
    """Every parameter, and every part of a fused one, came from the checkpoint
    (ids, not names: a tied head shares the embedding's parameter)."""
    missing = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            expected = getattr(module, "expected_shards", None)  # per parameter (stacked experts)
            parts = set(expected(param_name) if expected else getattr(module, "shard_ids", (None,)))
            if not parts <= loaded.get(id(param), set()):
                missing.append(f"{module_name}.{param_name}")
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} weights, e.g. {missing[:3]}")


def init_dummy(model: nn.Module, seed: int, method: QuantMethod | None = None) -> None:
    """Random weights of the real shapes: N(0, 0.02) like HF's init, norms at
    1; weights held quantised (by `method`) quantised from such values in their layer's form."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif not name.endswith("weight_scale"):
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    if method is None:
        return
    for module in model.modules():
        if isinstance(module, QuantizableLinear) and module.quant is not None:
            method.fill_dummy(module, torch.randn(module.weight.shape, generator=generator) * 0.02)


def build_model(
    config: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    round_to: torch.dtype | None = None,
    matmul_dtype: torch.dtype | None = None,
    fp8_matmul: str = "auto",
) -> CausalLM:
    """The model with parameters in `dtype`; with `round_to`, their values are
    rounded to that (narrower) dtype first (half weights computed in float32).
    With `matmul_dtype`, the matmul weights (modules with a `matmul_choice`)
    are held in it from the start: the native matmul reads them at that
    width, and the checkpoint loads without a float32 copy of them (Qwen3-0.6B
    bf16 computed in float32: ~3 s of a ~6 s load). `fp8_matmul` (auto,
    force, off): which layers of a quantised checkpoint hold its quantised
    weights (QuantMethod.prepare; quant/fp8_layers.py's use_fp8_matmuls for FP8)."""
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)(config)
    if not isinstance(model, nn.Module):  # the loading below finds each weight's module by its checkpoint name
        raise TypeError(f"{config.architecture}: {type(model).__name__} is not a torch module")
    if matmul_dtype is not None:
        for module in model.modules():
            if hasattr(module, "matmul_choice"):  # (untouched yet: torch.empty only reserved the wide copy)
                weight = cast(torch.Tensor, module.weight)
                weight.data = torch.empty(weight.shape, dtype=matmul_dtype, device=device)
    method = config.quantization
    if method is not None:
        from_file = load_format in ("auto", "safetensors")
        method.prepare(model, device, dtype, fp8_matmul,
                       quantised_layers(model, config, method, path) if from_file else None)
    stored: set[torch.dtype] = {dtype}
    if load_format == "dummy":
        init_dummy(model, seed, method)
    elif load_format in ("auto", "safetensors"):
        stored = load_safetensors(model, config, path)
    else:
        raise ValueError(f"unknown load_format {load_format!r} (auto, safetensors, dummy)")
    if method is not None:
        method.after_loading(model, dtype)  # (before the rounding below: a layer it dequantises is rounded too)
    _round_values(model, dtype, round_to, stored)
    return model.eval()


def _round_values(module: nn.Module, dtype: torch.dtype, round_to: torch.dtype | None, stored: set[torch.dtype]) -> None:
    """Round the parameters' values to `round_to` (half weights computed in
    `dtype`). A checkpoint stored in `round_to` has nothing to round
    (Qwen3-0.6B's bf16: a 1.3 s pass saved)."""
    if round_to is None or round_to == dtype or stored == {round_to}:
        return
    for name, param in module.named_parameters():
        # (one-byte weights are quantised ones, their scales float32: both kept as stored)
        if param.dtype != round_to and param.element_size() > 1 and not name.endswith("weight_scale"):
            param.data.copy_(param.data.to(round_to))


def build_module(
    factory: Callable[[], nn.Module], config: ModelConfig, path: Path, dtype: torch.dtype, device: torch.device,
    round_to: torch.dtype | None = None,
) -> nn.Module:
    """A module that is no registered family (an EAGLE-3 draft head), built
    in `dtype` on `device` and loaded from the safetensors at `path` as
    build_model loads a family: by its checkpoint names (the module's
    `checkpoint_name` maps them), every parameter required; with `round_to`,
    the values rounded to that narrower dtype."""
    with _default_dtype(dtype), torch.device(device):
        module = factory()
    _round_values(module, dtype, round_to, load_safetensors(module, config, path))
    return module.eval()
