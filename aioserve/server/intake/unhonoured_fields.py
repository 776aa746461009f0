"""Request fields of vLLM, SGLang or OpenAI that aioserve cannot honour:
answered with a 400 naming the field rather than accepted and dropped (a
client that sends a LoRA adapter or an image must learn it was not used).
A field sent with its neutral value (null, false, an empty list, text-only
modalities) asks for nothing and passes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioserve.server.errors import APIError

# vLLM's way: a LoRA adapter is the request's `model` (SGLang's /generate takes lora_path).
NO_LORA = "name a LoRA adapter (--enable-lora) in the `model` field; lora_path is SGLang's /generate field"
TEXT_ONLY = "this model takes text only"

# Fields of /v1/completions and /v1/chat/completions (vLLM's and SGLang's extras).
OPENAI_FIELDS: Mapping[str, str] = {
    "lora_path": NO_LORA,
    "lora_request": NO_LORA,
    "image_data": "images come as image_url content parts of a chat message (image_data is SGLang's /generate field)",
    "audio": f"{TEXT_ONLY}: no audio output",
    "mm_processor_kwargs": TEXT_ONLY,
    "prompt_embeds": "prompt embeddings are not supported (send text or token ids)",
    "use_beam_search": "beam search is not supported",
    "logits_processors": "custom logits processors are not supported",
    "bad_words": "bad_words is not supported (logit_bias can ban tokens)",
    "allowed_token_ids": "allowed_token_ids is not supported (logit_bias or a grammar can restrict tokens)",
    "truncate_prompt_tokens": "prompt truncation is not supported: a prompt over the context length is refused",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "modalities": f"{TEXT_ONLY}: only the text modality",
}

# Fields of SGLang's /generate. (Its image_data is taken for a
# vision-language model and refused for a text-only one when the request is
# served: server/intake/image_parts.py.)
GENERATE_FIELDS: Mapping[str, str] = {
    "lora_id": "name the LoRA adapter in lora_path",
    "video_data": TEXT_ONLY,
    "audio_data": TEXT_ONLY,
    "input_embeds": "input embeddings are not supported (send text or input_ids)",
    "custom_logit_processor": "custom logit processors are not supported",
    "return_hidden_states": "hidden states are not returned by this server",
    "session_params": "sessions are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
}


def _asks_for_something(name: str, value: Any) -> bool:
    if name == "modalities":
        return value not in (None, ["text"])
    return value not in (None, False, "", [], {})


def refuse_unhonoured(data: Any, fields: Mapping[str, str], prefix: str = "") -> None:
    """A 400 for the first field of `fields` that `data` (the raw body, a
    dict) sets to something aioserve would have to ignore."""
    if not isinstance(data, dict):
        return
    for name, reason in fields.items():
        if _asks_for_something(name, data.get(name)):
            raise APIError(f"{prefix}{name} is not supported: {reason}", param=f"{prefix}{name}")
