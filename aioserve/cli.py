"""`aioserve serve --model PATH_OR_HF_ID [options]` (also `python -m aioserve serve`)."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from aioserve.attention import BACKENDS
from aioserve.config import EngineConfig, ServerArgs


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([\d.e+]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    scale = 1024 ** "_kmgt".index(match.group(2) or "_")
    return int(float(match.group(1)) * scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioserve", description="OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the HTTP server")

    model = serve.add_argument_group("model")
    model.add_argument("--model", required=True, help="a Hugging Face folder or model id")
    model.add_argument("--tokenizer", help="tokenizer folder (default: the model's)")
    model.add_argument("--served-model-name", help="the name clients use (default: --model)")
    model.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    model.add_argument(
        "--cpu-half-compute", default="auto", choices=["auto", "native", "float32"],
        help="half-precision math on CPU: native, or float32 with rounded weights (auto: float32 "
        "unless the CPU has AVX512-BF16/AMX)",
    )
    model.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    model.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    model.add_argument("--chat-template", help="a Jinja file that replaces the tokenizer's chat template")
    model.add_argument("--seed", type=int, default=0, help="for dummy weights and unseeded sampling")

    memory = serve.add_argument_group("KV cache")
    memory.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    memory.add_argument("--num-pages", type=int, help="KV pool size in pages (overrides the memory budget)")
    memory.add_argument("--kv-cache-memory", type=parse_bytes, help="KV pool bytes on CPU, e.g. 4GiB")
    memory.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="share of free GPU memory for KV")
    memory.add_argument("--kv-cache-dtype", default="auto", help="auto (the weights' dtype) | float32 | bfloat16 | float16")
    memory.add_argument("--cache", default="radix", choices=["radix", "naive"], help="prefix cache")

    sched = serve.add_argument_group("scheduling")
    sched.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    sched.add_argument("--max-running-requests", type=int, default=256)
    sched.add_argument("--max-prefill-tokens", type=int, default=8192, help="prefill tokens per step (chunking)")
    sched.add_argument("--decode-reserve-tokens", type=int, default=64, help="KV room kept per admitted request")
    sched.add_argument("--disable-overlap", action="store_true", help="plain sequential loop")
    sched.add_argument("--attention-backend", default="auto", choices=list(BACKENDS))
    sched.add_argument("--num-threads", type=int, help="torch threads on CPU")
    sched.add_argument("--debug-integrity", action="store_true", help="check KV bookkeeping when idle")

    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    http.add_argument("--tokenizer-workers", type=int, default=4)
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def server_args(ns: argparse.Namespace) -> ServerArgs:
    engine = EngineConfig(
        model=ns.model,
        tokenizer=ns.tokenizer,
        dtype=ns.dtype,
        cpu_half_compute=ns.cpu_half_compute,
        device=ns.device,
        load_format=ns.load_format,
        seed=ns.seed,
        page_size=ns.page_size,
        num_pages=ns.num_pages,
        kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_dtype=ns.kv_cache_dtype,
        cache=ns.cache,
        max_model_len=ns.max_model_len,
        max_running_requests=ns.max_running_requests,
        max_prefill_tokens=ns.max_prefill_tokens,
        decode_reserve_tokens=ns.decode_reserve_tokens,
        overlap=not ns.disable_overlap,
        attention_backend=ns.attention_backend,
        num_threads=ns.num_threads,
        debug_integrity=ns.debug_integrity,
    )
    return ServerArgs(
        engine=engine,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        chat_template=ns.chat_template,
        api_key=ns.api_key,
        tokenizer_workers=ns.tokenizer_workers,
        log_level=ns.log_level,
    )


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from aioserve.runtime import run_server

    run_server(server_args(ns))


if __name__ == "__main__":
    main()
