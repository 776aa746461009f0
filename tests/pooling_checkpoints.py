"""Tiny random-weight pooling checkpoints, saved the way people get them:
sentence-transformers folders (modules.json, 1_Pooling, 2_Normalize) around
a Qwen3 decoder or a BERT encoder, and a BERT cross-encoder
(BertForSequenceClassification, one label) as CrossEncoder saves it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import build_checkpoint

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
         "the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "a", "##s", "##ed", "is", "what", "where"]
BERT_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64, initializer_range=0.2)


def _bert_tokenizer(folder: Path) -> None:
    from transformers import BertTokenizerFast

    BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(str(folder))


def _sentence_transformer(base: Path, out: Path, pooling: str) -> Path:
    import sentence_transformers as st

    modules = getattr(st, "sentence_transformer", None)  # where 6.x keeps them; older: st.models
    modules = getattr(modules, "modules", None) or st.models
    transformer = modules.Transformer(str(base))
    named = "get_embedding_dimension" if hasattr(transformer, "get_embedding_dimension") else "get_word_embedding_dimension"
    size = getattr(transformer, named)()
    pooler = modules.Pooling(size, pooling)
    st.SentenceTransformer(modules=[transformer, pooler, modules.Normalize()]).save(str(out))
    return out


def qwen3_embedder(root: Path) -> Path:
    """A Qwen3 decoder with last-token pooling, normalised (Qwen3-Embedding's
    layout). Its tokenizer has no chat template: sentence-transformers would
    otherwise wrap every text in it."""
    base = build_checkpoint("qwen3", root / "qwen3-base")
    (base / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(settings))
    return _sentence_transformer(base, root / "qwen3-embedder", "lasttoken")


def bert_embedder(root: Path, pooling: str = "mean") -> Path:
    """A BERT encoder (all-MiniLM's layout) with `pooling` (mean or cls), normalised."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    base = root / f"bert-base-{pooling}"
    BertModel(BertConfig(vocab_size=len(WORDS), **BERT_SIZES)).eval().save_pretrained(str(base))
    _bert_tokenizer(base)
    return _sentence_transformer(base, root / f"bert-embedder-{pooling}", pooling)


def bert_cross_encoder(root: Path) -> Path:
    """A BERT cross-encoder (ms-marco MiniLM's layout): one relevance logit."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    folder = root / "bert-reranker"
    config = BertConfig(vocab_size=len(WORDS), num_labels=1, **BERT_SIZES)
    BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    _bert_tokenizer(folder)
    return folder


def hand_written_layout(folder: Path, pooling: str) -> Path:
    """The sentence-transformers files around a saved model, written without
    sentence-transformers (a GPU machine has no such package): modules.json,
    1_Pooling/config.json (`pooling` as its pooling_mode), 2_Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": pooling}))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def bert_model_folder(root: Path, name: str = "bert") -> Path:
    """A saved BertModel with its tokenizer (no sentence-transformers files)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    folder = root / name
    BertModel(BertConfig(vocab_size=len(WORDS), **BERT_SIZES)).eval().save_pretrained(str(folder))
    _bert_tokenizer(folder)
    return folder


XLMR_SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's first ids: <pad> is 1, its positions start past it


def _xlmr_tokenizer(folder: Path) -> None:
    """A word-level tokenizer with XLM-R's special tokens and pair template
    (<s> A </s></s> B </s>): sentencepiece's vocabulary is beside the point."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(XLMR_SPECIAL + WORDS[5:])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                            cls_token="<s>", pad_token="<pad>", unk_token="<unk>").save_pretrained(str(folder))


def _xlmr_config(**extra: object):
    from transformers import XLMRobertaConfig

    sizes = {**BERT_SIZES, "max_position_embeddings": 66}  # 64 positions past <pad>'s 1 (XLM-R's 514 = 512 + 2)
    return XLMRobertaConfig(vocab_size=len(XLMR_SPECIAL) + len(WORDS) - 5, type_vocab_size=1, pad_token_id=1,
                            bos_token_id=0, eos_token_id=2, **sizes, **extra)


def xlmr_embedder(root: Path) -> Path:
    """An XLM-R encoder (multilingual-e5's layout): mean pooling, normalised."""
    from transformers import XLMRobertaModel

    torch.manual_seed(3)
    base = root / "xlmr-base"
    XLMRobertaModel(_xlmr_config()).eval().save_pretrained(str(base))
    _xlmr_tokenizer(base)
    return _sentence_transformer(base, root / "xlmr-embedder", "mean")


def xlmr_cross_encoder(root: Path) -> Path:
    """An XLM-R cross-encoder (bge-reranker's layout): one relevance logit."""
    from transformers import XLMRobertaForSequenceClassification

    torch.manual_seed(4)
    folder = root / "xlmr-reranker"
    XLMRobertaForSequenceClassification(_xlmr_config(num_labels=1)).eval().save_pretrained(str(folder))
    _xlmr_tokenizer(folder)
    return folder
