"""Architecture name (config.json `architectures[0]`) -> model class: each
builds a `CausalLM` (models/causal_lm.py), the one type the rest of aioserve
knows a model by."""

from __future__ import annotations

from aioserve.config import ConfigError
from aioserve.models.bert import BertModel, XLMRobertaModel
from aioserve.models.bert_classification import BertForSequenceClassification, XLMRobertaForSequenceClassification
from aioserve.models.causal_lm import ModelClass
from aioserve.models.gemma3 import Gemma3ForCausalLM
from aioserve.models.gemma3_vl import Gemma3ForConditionalGeneration
from aioserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from aioserve.models.mixtral import MixtralForCausalLM
from aioserve.models.model_config import ModelConfig
from aioserve.models.qwen2 import Qwen2ForCausalLM
from aioserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from aioserve.models.qwen3 import Qwen3ForCausalLM
from aioserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, ModelClass] = {
    "BertForSequenceClassification": BertForSequenceClassification,
    "BertModel": BertModel,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
}


def model_class(config: ModelConfig) -> ModelClass:
    if config.wrapper == "Gemma3ForConditionalGeneration" and config.vision is not None:
        return Gemma3ForConditionalGeneration  # served whole, with its vision tower
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ConfigError(f"unsupported architecture {config.architecture!r} (supported: {supported})") from None
