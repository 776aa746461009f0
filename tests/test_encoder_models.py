"""The encoders (BERT, XLM-R) and their sequence classifiers against
transformers in float32: tiny random checkpoints loaded by aioserve's
loader, several sequences of different lengths run in one step through the
torch_native backend planned not causal, each sequence compared with
transformers run on it alone. Also: the [SEP] rule for token types, the
checkpoint name styles (task prefix or none), the [SEP] id read from the
tokenizer files, non-causal plans that are refused, and the FlashInfer
backend's non-causal planning (against the CPU fake)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioserve.attention import create_backend
from aioserve.attention.backend import AttentionShape
from aioserve.attention.flashinfer import FlashInferBackend
from aioserve.attention.torch_native import TorchNativeBackend
from aioserve.batch_plan import BatchPlan
from aioserve.kvcache.kv_pool import KVPool
from aioserve.models.bert import pair_token_types
from aioserve.models.encoder_lm import NoLMHeadError
from aioserve.models.model_config import ModelConfig
from aioserve.models.special_tokens import special_token_id
from aioserve.models.weight_loader import build_model
from fake_flashinfer import fake_flashinfer

PAGE = 4
CPU = torch.device("cpu")
TOL = 1e-4
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, initializer_range=0.1)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
         "the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "##s", "##ed"]
# Lengths of one step's sequences: a one-token one, side-by-side equal ones
# (the batched path), and others between them.
LENGTHS = [7, 12, 12, 1, 5, 12, 30]


def _save(model: torch.nn.Module, folder: Path, prefix: str | None = None, extra: dict | None = None) -> Path:
    """save_pretrained; with `prefix`, the tensors renamed as a task model's
    checkpoint names them (plus `extra` ones it would carry)."""
    model.save_pretrained(str(folder))
    if prefix is not None:
        weights = load_file(str(folder / "model.safetensors"))
        renamed = {prefix + name: t.contiguous() for name, t in weights.items()}
        renamed.update(extra or {})
        save_file(renamed, str(folder / "model.safetensors"))
    return folder


def _bert_tokenizer(folder: Path) -> None:
    from transformers import BertTokenizerFast

    BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(str(folder))


def _config(family: str, **extra: object):
    from transformers import BertConfig, XLMRobertaConfig

    if family == "bert":
        return BertConfig(vocab_size=len(WORDS), type_vocab_size=2, **TINY, **extra)
    # XLM-R's real checkpoints: one token type, positions past padding_idx 1.
    return XLMRobertaConfig(vocab_size=250, type_vocab_size=1, pad_token_id=1, **TINY, **extra)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (folder, the transformers model it holds, in eval mode)."""
    import transformers

    root = tmp_path_factory.mktemp("encoders")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}
    specs = [
        ("bert", "BertModel", "bert", None, {}),
        ("bert-prefixed", "BertModel", "bert", "bert.", {"cls.predictions.bias": torch.zeros(len(WORDS))}),
        ("xlmr", "XLMRobertaModel", "xlmr", None, {}),
        ("xlmr-prefixed", "XLMRobertaModel", "xlmr", "roberta.", {"lm_head.bias": torch.zeros(250)}),
        ("bert-cls", "BertForSequenceClassification", "bert", None, {"num_labels": 3}),
        ("xlmr-cls", "XLMRobertaForSequenceClassification", "xlmr", None, {"num_labels": 1}),
    ]
    for seed, (name, arch, family, prefix, extra) in enumerate(specs):
        torch.manual_seed(seed)
        options = {} if prefix is not None else extra
        config = _config(family, architectures=[arch], **options)
        model = getattr(transformers, arch)(config).eval()
        folder = _save(model, root / name, prefix, extra if prefix is not None else None)
        if family == "bert":
            _bert_tokenizer(folder)
        built[name] = (folder, model)
    return built


def whole_sequences_plan(sequences: list[list[int]], first_page: int = 1) -> BatchPlan:
    """One step holding every sequence whole from position 0, each on pages of its own."""
    ids, positions, slots, rows = [], [], [], []
    width = max(-(-len(s) // PAGE) for s in sequences)
    page = first_page
    for seq in sequences:
        pages = list(range(page, page + width))
        page += width
        rows.append(pages)
        for pos, token in enumerate(seq):
            ids.append(token)
            positions.append(pos)
            slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
    return BatchPlan(
        step=0, input_ids=torch.tensor(ids), positions=torch.tensor(positions), out_cache_loc=torch.tensor(slots),
        seq_lens=torch.tensor([len(s) for s in sequences]), extend_lens=torch.tensor([len(s) for s in sequences]),
        page_table=torch.tensor(rows, dtype=torch.int32), num_decodes=0,
        logits_indices=torch.tensor([], dtype=torch.long), sampling=None,
    )


def run_encoder(model, config: ModelConfig, sequences: list[list[int]], backend_cls=None) -> list[torch.Tensor]:
    """Every sequence through `model` in one step: its hidden states, [len, hidden] each."""
    pages = 1 + len(sequences) * -(-max(map(len, sequences)) // PAGE)
    pool = KVPool(config.num_layers, pages, PAGE, config.num_kv_heads, config.head_dim, torch.float32, CPU)
    shape = AttentionShape(config.num_heads, config.num_kv_heads, config.head_dim,
                           tuple(config.sliding_windows), torch.float32, config.attention_scale, causal=False)
    backend = backend_cls(pool, shape) if backend_cls else create_backend("torch_native", pool, shape)
    plan = whole_sequences_plan(sequences)
    with torch.inference_mode():
        hidden = model(plan.input_ids, plan.positions, backend.prepare(plan, plan))
    return list(hidden.split([len(s) for s in sequences]))


def load(folder: Path):
    config = ModelConfig.from_path(folder)
    return build_model(config, folder, torch.float32, CPU, "auto", 0), config


def random_sequences(vocab: int, first: int, last: int, seed: int = 0) -> list[list[int]]:
    """LENGTHS sequences, each [first] + random ids (no special one) + [last] (the lone one: just [first])."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        body = torch.randint(5, vocab, (max(0, n - 2),), generator=gen).tolist()
        out.append([first] if n == 1 else [first, *body, last])
    return out


@pytest.mark.parametrize("name", ["bert", "bert-prefixed", "xlmr", "xlmr-prefixed"])
def test_last_hidden_state_matches_transformers(checkpoints, name: str) -> None:
    folder, hf = checkpoints[name]
    model, config = load(folder)
    assert model.is_encoder and config.is_encoder
    vocab = config.vocab_size
    sequences = random_sequences(vocab, *((2, 3) if name.startswith("bert") else (0, 2)))
    ours = run_encoder(model, config, sequences)
    with torch.inference_mode():
        for seq, got in zip(sequences, ours):
            expected = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
            assert (got - expected).abs().max().item() < TOL, f"a sequence of {len(seq)}"


def test_xlmr_positions_start_past_padding(checkpoints) -> None:
    config = ModelConfig.from_path(checkpoints["xlmr"][0])
    assert config.encoder is not None and config.encoder.position_offset == 2
    assert config.max_position_embeddings == TINY["max_position_embeddings"] - 2  # what the engine may use


def test_bert_pair_scores_match_transformers(checkpoints) -> None:
    """Pairs and single texts, token types from the tokenizer for transformers
    and from the [SEP] rule for aioserve."""
    from transformers import AutoTokenizer

    folder, hf = checkpoints["bert-cls"]
    model, config = load(folder)
    assert config.encoder is not None and config.encoder.sep_token_id == WORDS.index("[SEP]")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    texts = [("the cat sat", "on the mats"), ("a dog ran far away",), ("the dog", "the cat sat on a mat"),
             ("cat",), ("a b c d e f g", "the mat")]
    encoded = [tokenizer(*t) for t in texts]
    assert any(1 in e["token_type_ids"] for e in encoded)
    sequences = [e["input_ids"] for e in encoded]
    hidden = run_encoder(model, config, sequences)
    scores = model.score_head(torch.stack([h[0] for h in hidden]))
    assert scores.dtype == torch.float32 and scores.shape == (len(texts), 3) and model.score_row == "first"
    with torch.inference_mode():
        for e, got in zip(encoded, scores):
            expected = hf(input_ids=torch.tensor([e["input_ids"]]),
                          token_type_ids=torch.tensor([e["token_type_ids"]])).logits[0]
            assert (got - expected).abs().max().item() < TOL, e
            types = pair_token_types(torch.tensor(e["input_ids"]), torch.arange(len(e["input_ids"])), config.encoder.sep_token_id)
            assert types.tolist() == e["token_type_ids"]


def test_xlmr_scores_match_transformers(checkpoints) -> None:
    folder, hf = checkpoints["xlmr-cls"]
    model, config = load(folder)
    sequences = random_sequences(config.vocab_size, 0, 2, seed=1)
    sequences[1] = [0, *sequences[1][1:3], 2, 2, *sequences[1][3:]]  # a pair: <s> A </s></s> B </s>
    hidden = run_encoder(model, config, sequences)
    scores = model.score_head(torch.stack([h[0] for h in hidden]))
    assert scores.shape == (len(sequences), 1)
    with torch.inference_mode():
        for seq, got in zip(sequences, scores):
            expected = hf(input_ids=torch.tensor([seq])).logits[0]
            assert (got - expected).abs().max().item() < TOL


def test_pair_token_types_per_sequence() -> None:
    sep = 3
    #            seq 1: CLS A SEP B B SEP | seq 2: CLS A A | seq 3: CLS SEP B SEP
    ids = torch.tensor([2, 9, 3, 8, 8, 3, 2, 9, 9, 2, 3, 7, 3])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3])
    assert pair_token_types(ids, positions, sep).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]


def test_encoders_have_no_lm_head(checkpoints) -> None:
    model, _ = load(checkpoints["bert"][0])
    with pytest.raises(NoLMHeadError, match="encoder"):
        model.compute_logits(torch.zeros(1, 64))
    with pytest.raises(NoLMHeadError):
        model.lm_head
    assert model.embed_tokens is model.embeddings.word_embeddings
    assert len(model.decoder_layers()) == 2


def _plan_after(prefix: int, length: int) -> BatchPlan:
    """A request of `length` new tokens after `prefix` in the cache: a later chunk, or a cached prefix."""
    plan = whole_sequences_plan([[5] * (prefix + length)])
    keep = slice(prefix, prefix + length)
    plan.input_ids, plan.positions, plan.out_cache_loc = plan.input_ids[keep], plan.positions[keep], plan.out_cache_loc[keep]
    plan.extend_lens = torch.tensor([length])
    plan.num_decodes = int(length == 1)  # one new token after a prefix: a decode
    return plan


@pytest.mark.parametrize("prefix,length", [(8, 4), (3, 1), (16, 20)], ids=["chunk", "decode", "cached-prefix"])
@pytest.mark.parametrize("backend", ["torch_native", "flashinfer"])
def test_non_causal_plans_must_hold_whole_sequences(prefix: int, length: int, backend: str) -> None:
    pool = KVPool(1, 20, PAGE, 2, 64, torch.float32, CPU)
    shape = AttentionShape(4, 2, 64, (None,), torch.float32, causal=False)
    attention = TorchNativeBackend(pool, causal=False) if backend == "torch_native" else FlashInferBackend(
        pool, shape, fake_flashinfer)
    bad = _plan_after(prefix, length)
    with pytest.raises(ValueError, match="arrive whole"):
        attention.prepare(bad, bad)
    good = whole_sequences_plan([[5] * 9, [6] * 3])
    attention.prepare(good, good)  # whole sequences: planned
    causal = TorchNativeBackend(pool) if backend == "torch_native" else FlashInferBackend(
        pool, AttentionShape(4, 2, 64, (None,), torch.float32), fake_flashinfer)
    causal.prepare(bad, bad)  # a decoder's chunk is fine


def test_flashinfer_plans_encoders_not_causal(tmp_path: Path) -> None:
    """The FlashInfer backend (against the CPU fake, which models the
    wrappers' plan arguments) plans the extends with causal=False and gives
    the torch backend's hidden states (head_dim 64: the fake, like the real
    kernels, has none for 16)."""
    from transformers import BertModel as HFBert

    torch.manual_seed(5)
    config = _config("bert", architectures=["BertModel"])
    config.hidden_size, config.intermediate_size = 256, 256
    folder = _save(HFBert(config).eval(), tmp_path / "bert-hd64")
    _bert_tokenizer(folder)
    model, mc = load(folder)
    assert mc.head_dim == 64
    sequences = random_sequences(mc.vocab_size, 2, 3, seed=3)
    reference = run_encoder(model, mc, sequences)
    planned = []
    real_plan = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def recording_plan(self, *args, **kwargs):
        planned.append(kwargs["causal"])
        return real_plan(self, *args, **kwargs)

    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan = recording_plan
    try:
        fake = run_encoder(model, mc, sequences, lambda pool, shape: FlashInferBackend(pool, shape, fake_flashinfer))
    finally:
        fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan = real_plan
    assert planned == [False]
    for got, expected in zip(fake, reference):
        assert (got - expected).abs().max().item() < TOL


def test_sep_id_from_the_tokenizer_files(tmp_path: Path, checkpoints) -> None:
    assert special_token_id(checkpoints["bert"][0], "sep_token") == 3  # tokenizer.json + tokenizer_config.json
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    (slow / "special_tokens_map.json").write_text(json.dumps({"sep_token": {"content": "[SEP]"}}))
    assert special_token_id(slow, "sep_token") == 3
    unigram = tmp_path / "unigram"
    unigram.mkdir()
    (unigram / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "Unigram", "vocab": [["<s>", 0.0], ["<pad>", 0.0], ["</s>", 0.0]]},
        "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]},
    }))
    assert special_token_id(unigram, "sep_token") == 2
    (unigram / "tokenizer_config.json").write_text(json.dumps({"sep_token": "<pad>"}))
    assert special_token_id(unigram, "sep_token") == 1  # the config's name wins, looked up in the vocabulary
    assert special_token_id(tmp_path, "sep_token") is None
