"""Tiny random-weight Hugging Face checkpoints, built by the tests themselves.

Each is a real `save_pretrained` folder (config.json, safetensors, a trained
byte-level BPE tokenizer with a ChatML chat template), seeded so every run
builds the same bytes. They cover the architectures and config features the
engine must handle: GQA, llama3 rope scaling, untied and tied embeddings, a
sharded checkpoint with an index, Mistral's sliding window, Qwen2's q/k/v
bias and Qwen3's q/k norms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS = """Once upon a time there was a little robot who loved to read books about the sea.
Every morning the robot walked to the library, opened a big blue book and read about fish,
whales, boats and storms. One day the librarian asked: what will you do when you finish all
the books? The robot smiled and said that it would write a new one, about a robot who reads.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ! ? , . ;
Héllo wörld, naïve café, 世界 你好, emoji 🙂 🚀 and the end of the story.
""" * 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.08,  # wider than HF's 0.02: decisive logits, no near-ties in greedy
)

# name -> (config class name, extra config fields, save options)
ARCHITECTURES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}, {}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {"max_shard_size": "60KB"},  # several shards + model.safetensors.index.json
    ),
    "mistral": ("MistralConfig", {"sliding_window": 24, "tie_word_embeddings": False}, {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, {}),
}

# Mixture-of-experts families: built on demand (the MoE tests), not by every
# test that walks ARCHITECTURES. Qwen3-MoE's second layer is a dense MLP
# (mlp_only_layers) and its top-k is renormalised; Mixtral has a sliding window.
MOE_ARCHITECTURES: dict[str, tuple[str, dict, dict]] = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"head_dim": 32, "tie_word_embeddings": False, "num_hidden_layers": 3, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]},
        {},
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 24,
         "tie_word_embeddings": False},
        {},
    ),
}


# Gemma 3's chat template as published with its checkpoints: a system
# message folded into the first user turn, "model" for the assistant, roles
# that must alternate.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's special tokens (in vocabulary order), its EOS and BOS and chat template."""

    specials: tuple[str, ...]
    eos: str
    bos: str | None
    template: str


CHATML = ChatFormat(tuple(SPECIAL_TOKENS), "<|im_end|>", None, CHATML_TEMPLATE)
GEMMA3_CHAT = ChatFormat(("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "<bos>", GEMMA3_TEMPLATE)

# Gemma 3 (text), built on demand by its tests: sliding layers around a
# global one with a window shorter than the test prompts, a softmax scale
# that is not head_dim's, linear rope scaling on the global layer only,
# soft-capped logits and Gemma's chat template.
GEMMA3 = (
    "Gemma3TextConfig",
    {"head_dim": 32, "num_hidden_layers": 3, "sliding_window": 12, "query_pre_attn_scalar": 24,
     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
     "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
     "final_logit_softcapping": 5.0, "tie_word_embeddings": True},
    {},
)
MODEL_CLASSES = {"Gemma3TextConfig": "Gemma3ForCausalLM"}  # where the name is not the config's with ForCausalLM


def build_tokenizer(folder: Path, vocab_size: int = 320, chat: ChatFormat = CHATML) -> int:
    """Train a byte-level BPE on CORPUS and save it with a chat template;
    returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chat.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": chat.eos,
                "pad_token": chat.specials[0],
                "bos_token": chat.bos,
                "chat_template": chat.template,
                "model_max_length": TINY["max_position_embeddings"],
            }
        )
    )
    return tokenizer.get_vocab_size()


def build_checkpoint(name: str, folder: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Write the tiny `name` checkpoint (see ARCHITECTURES) into `folder`,
    with `overrides` on its config fields (other shapes of the same family)."""
    import transformers

    config_class, extra, save_options = {**ARCHITECTURES, **MOE_ARCHITECTURES, "gemma3": GEMMA3}[name]
    from tokenizers import Tokenizer

    chat = GEMMA3_CHAT if name == "gemma3" else CHATML
    vocab = build_tokenizer(folder, chat=chat)
    trained = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = trained.token_to_id(chat.eos)
    bos = trained.token_to_id(chat.bos) if chat.bos else None
    fields = {**TINY, **extra, **(overrides or {})}
    # A few embedding rows beyond the tokenizer, as real checkpoints often have.
    config = getattr(transformers, config_class)(vocab_size=vocab + 8, eos_token_id=eos, bos_token_id=bos, **fields)
    torch.manual_seed(seed)
    model_class = MODEL_CLASSES.get(config_class, config_class.replace("Config", "ForCausalLM"))
    model = getattr(transformers, model_class)(config).eval()
    if name == "gemma3":  # its norms start at w = 0, a multiplier of 1 + w: make the 1 + w matter
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True, **save_options)
    return folder


def build_gemma3_multimodal(folder: Path, text_overrides: dict | None = None, vision_overrides: dict | None = None,
                            **config_overrides: object) -> Path:
    """A tiny Gemma3ForConditionalGeneration (Gemma 3 4B-27B's layout): the
    tiny Gemma 3 text model inside, a one-layer SigLIP tower beside it, saved
    as the hub checkpoints are (language_model.model.*, vision_tower.*).
    The text config leaves out what transformers' defaults give, as hub
    configs do; transformers' wrapper applies no final logit soft-capping,
    and Gemma 3's published configs set none, so neither does this one."""
    import shutil

    import transformers

    text_folder = build_checkpoint("gemma3", folder.parent / (folder.name + "-text"),
                                   overrides={"final_logit_softcapping": None, **(text_overrides or {})})
    text = json.loads((text_folder / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    sparse_text = {k: v for k, v in text.items() if k == "model_type" or defaults.get(k) != v}
    vision = transformers.SiglipVisionConfig(**{
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 28, "patch_size": 14, **(vision_overrides or {}),
    })
    config = transformers.Gemma3Config(**{
        "text_config": sparse_text, "vision_config": vision.to_dict(), "mm_tokens_per_image": 4,
        "eos_token_id": text["eos_token_id"], "bos_token_id": text["bos_token_id"], **config_overrides,
    })
    wrapper = transformers.Gemma3ForConditionalGeneration(config).eval()
    text_model = transformers.AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    wrapper.model.language_model.load_state_dict(text_model.model.state_dict())
    wrapper.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_folder / name, folder / name)
    return folder


def build_eagle3_head(
    folder: Path, target: Path, seed: int = 0, draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None, config_overrides: dict | None = None,
) -> Path:
    """A random EAGLE-3 head for the checkpoint at `target`, saved as the
    published heads are (LlamaForCausalLMEagle3: `fc`, `midlayer.*`, `norm`,
    `lm_head` over a draft vocabulary, `d2t` draft -> target offsets and the
    `t2d` mask). `draft_vocab_size`: a random subset of the target's tokens
    (default: all of them); `aux_layer_ids`: eagle_config's layer ids (the
    default reads layers 2, L/2, L-3)."""
    from safetensors.torch import save_file

    target_config = json.loads((target / "config.json").read_text())
    hidden = target_config["hidden_size"]
    vocab = target_config["vocab_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // heads
    inter = target_config["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.08

    chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors = {
        "fc.weight": weight(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "midlayer.mlp.gate_proj.weight": weight(inter, hidden),
        "midlayer.mlp.up_proj.weight": weight(inter, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, inter),
        "norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "lm_head.weight": weight(draft_vocab, hidden),
        "d2t": chosen - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6), "rope_theta": target_config.get("rope_theta", 10000.0),
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048), "tie_word_embeddings": False,
        "torch_dtype": "float32", **(config_overrides or {}),
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder
