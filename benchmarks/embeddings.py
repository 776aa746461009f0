"""Embedding throughput: aioserve over HTTP beside sentence-transformers in process.

For each model shape (random weights in a sentence-transformers folder,
built here: no download), texts of 16-256 words (one token each in the
built vocabulary) are embedded by sentence-transformers' `encode` in this
process (its default batch of 32), then by an aioserve server at each
concurrency (requests of `--batch` texts each, as a vector-store loader
sends them). Vectors are checked equal (cosine) to sentence-transformers'.
A peer server (vLLM's `--runner pooling`) can be measured by its URL with
`--peer URL`; the ratio is then of one run on this machine.

    python benchmarks/embeddings.py                                # bge-small shape, 200 texts
    python benchmarks/embeddings.py --models bge-small qwen3-0.6b --num-texts 2000 --png emb.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import ServerProcess  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + [f"w{i}" for i in range(4000)]
# Shapes of the published checkpoints (their config.json), random weights.
SHAPES = {
    "bge-small": ("bert", dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=1536, max_position_embeddings=512), "cls"),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 max_position_embeddings=32768, tie_word_embeddings=True), "lasttoken"),
}


@dataclass
class Row:
    model: str
    runner: str
    concurrency: int
    texts: int
    tokens: int
    seconds: float

    @property
    def texts_per_s(self) -> float:
        return self.texts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def build_model(name: str, root: Path) -> Path:
    """A sentence-transformers folder of `name`'s shape with random weights."""
    import sentence_transformers as st
    import transformers

    # Where sentence-transformers 6 keeps its modules; older versions: st.models.
    st_models = getattr(getattr(st, "sentence_transformer", None), "modules", None) or st.models

    family, sizes, pooling = SHAPES[name]
    base = root / f"{name}-base"
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=len(VOCAB), **sizes))
    else:
        model = transformers.Qwen3Model(transformers.Qwen3Config(vocab_size=len(VOCAB), **sizes))
    model.eval().save_pretrained(str(base))
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(str(base))
    transformer = st_models.Transformer(str(base))
    pooler = st_models.Pooling(sizes["hidden_size"], pooling)
    out = root / name
    st.SentenceTransformer(modules=[transformer, pooler, st_models.Normalize()]).save(str(out))
    return out


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCAB[len(SPECIAL):]) for _ in range(rng.randint(16, 256))) for _ in range(count)]


def in_process(name: str, folder: Path, inputs: list[str]) -> tuple[Row, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    tokens = sum(len(t.split()) + 2 for t in inputs)
    start = time.perf_counter()
    vectors = model.encode(inputs, batch_size=32, convert_to_tensor=True, show_progress_bar=False)
    return Row(name, "sentence-transformers", 1, len(inputs), tokens, time.perf_counter() - start), vectors


async def over_http(url: str, model: str, inputs: list[str], concurrency: int, batch: int) -> tuple[float, list]:
    """Seconds to embed every input, `concurrency` requests of `batch` texts in flight."""
    chunks = [(i, inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
    vectors: list = [None] * len(inputs)
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    bar = tqdm(total=len(inputs), desc=f"{url} c={concurrency}", leave=False)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            first, part = queue.get_nowait()
            response = await client.post(f"{url}/v1/embeddings", json={"model": model, "input": part})
            response.raise_for_status()
            for item in response.json()["data"]:
                vectors[first + item["index"]] = item["embedding"]
            bar.update(len(part))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    bar.close()
    return time.perf_counter() - start, vectors


def served_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(name: str, folder: Path, inputs: list[str], concurrencies: list[int], batch: int,
            peer: str | None, server_args: list[str]) -> list[Row]:
    reference_row, reference = in_process(name, folder, inputs)
    rows = [reference_row]
    tokens = reference_row.tokens
    targets: list[tuple[str, str, ServerProcess | None]] = []
    server = ServerProcess.start(folder, *server_args, timeout=600)
    targets.append(("aioserve", server.url, server))
    if peer:
        targets.append(("peer", peer, None))
    try:
        for runner, url, _ in targets:
            model = served_name(url)
            asyncio.run(over_http(url, model, inputs[: 2 * batch], 1, batch))  # warm-up
            for concurrency in concurrencies:
                # A decoder embedder reuses cached prefixes: every run computes its texts afresh.
                httpx.post(f"{url.removesuffix('/v1')}/flush_cache", timeout=60)
                seconds, vectors = asyncio.run(over_http(url, model, inputs, concurrency, batch))
                cosine = torch.nn.functional.cosine_similarity(torch.tensor(vectors), reference.float()).min()
                if cosine < 0.999:
                    raise SystemExit(f"{runner}: vectors differ from sentence-transformers' (min cosine {cosine:.5f})")
                rows.append(Row(name, runner, concurrency, len(inputs), tokens, seconds))
    finally:
        server.stop()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| model | runner | concurrency | texts/s | tokens/s | vs sentence-transformers |", "|---|---|---|---|---|---|"]
    base = {r.model: r.texts_per_s for r in rows if r.runner == "sentence-transformers"}
    for r in rows:
        lines.append(f"| {r.model} | {r.runner} | {r.concurrency} | {r.texts_per_s:.1f} | {r.tokens_per_s:.0f} | "
                     f"{r.texts_per_s / base[r.model]:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    labels = [f"{r.model}\n{r.runner} c={r.concurrency}" for r in rows]
    axis.bar(range(len(rows)), [r.texts_per_s for r in rows])
    axis.set_xticks(range(len(rows)), labels, fontsize=7)
    axis.set_ylabel("texts / s")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bge-small"], choices=sorted(SHAPES))
    parser.add_argument("--num-texts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--batch", type=int, default=8, help="texts per request")
    parser.add_argument("--peer", help="URL of another server's OpenAI API root (e.g. vLLM --runner pooling)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to aioserve serve")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--png", help="write a bar chart here")
    args = parser.parse_args()
    inputs = texts(args.num_texts, seed=0)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            rows += measure(name, build_model(name, Path(root)), inputs, args.concurrency, args.batch, args.peer,
                            ["--dtype", "float32", *args.server_arg])
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"{args.num_texts} texts of 16-256 tokens, {args.batch} a request")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    if args.png:
        plot(rows, args.png)


if __name__ == "__main__":
    main()
