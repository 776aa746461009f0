"""Multi-LoRA beside vLLM's CPU build: both servers, the same checkpoint and
the same 16 rank-16 adapters, the same requests, in one run.

The checkpoint is the peers kit's tiny-llama (../shared/peers/setup.sh puts
it and vLLM's CPU venv in ~/.cache/aioserve-peers). Each server serves the
adapters by name (vLLM's `--enable-lora --lora-modules a0=PATH ...`, the
same flags for aioserve); 64 requests of 64-token prompts (token ids) and
64 output tokens, greedy with ignore_eos, at concurrency 16 over HTTP:
once naming the base model, once spread round-robin over the 16 adapters.
Prints out tok/s per server and setting, and each server's 16-adapter
throughput as a fraction of its own base and as a ratio to vLLM's.

    python benchmarks/lora_peers.py                 # aioserve and vLLM
    python benchmarks/lora_peers.py --peers aioserve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' PEFT-layout writer

from lora_adapters import write_raw_adapter  # noqa: E402

PEERS_HOME = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "aioserve-peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(peer: str, model: Path, adapters: list[Path], port: int, concurrency: int) -> tuple[list[str], dict]:
    modules = [f"a{i}={path}" for i, path in enumerate(adapters)]
    common = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", "16", "--lora-modules", *modules,
              "--max-num-seqs", str(concurrency), "--port", str(port), "--dtype", "float32"]
    env = dict(os.environ)
    if peer == "vllm":
        cpus = f"0-{(os.cpu_count() or 1) - 1}"
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpus, VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CACHE_ROOT=str(PEERS_HOME / "cache" / "vllm"))
        iomp = PEERS_HOME / "venv-vllm" / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        return [str(PEERS_HOME / "venv-vllm" / "bin" / "vllm"), "serve", str(model), "--served-model-name", "base",
                "--max-model-len", "2048", "--host", "127.0.0.1", *common], env
    return [sys.executable, "-m", "aioserve", "serve", "--model", str(model), "--served-model-name", "base",
            "--host", "127.0.0.1", *common], env


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the server did not become ready")


async def run_load(url: str, prompts: list[list[int]], models: list[str], tokens: int, concurrency: int) -> float:
    """Output tokens per second of all `prompts` (request i names models[i])."""
    gate = asyncio.Semaphore(concurrency)
    produced = 0

    async def one(client: httpx.AsyncClient, prompt: list[int], model: str) -> None:
        nonlocal produced
        async with gate:
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            response = await client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            produced += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, models)))
        return produced / (time.perf_counter() - start)


def measure(peer: str, model: Path, adapters: list[Path], args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command, env = server_command(peer, model, adapters, port, args.concurrency)
    log = open(Path(args.out) / f"{peer}.server.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = wait_ready(url, process, args.ready_timeout)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        names = [f"a{i}" for i in range(len(adapters))]
        warm = [names[i % len(names)] for i in range(args.concurrency)]
        asyncio.run(run_load(url, prompts[: args.concurrency], warm, 4, args.concurrency))  # loads every adapter
        base = asyncio.run(run_load(url, prompts, ["base"] * len(prompts), args.tokens, args.concurrency))
        mixed = asyncio.run(run_load(url, prompts, [names[i % len(names)] for i in range(len(prompts))],
                                     args.tokens, args.concurrency))
        return {"ready_s": ready, "base": base, "adapters": mixed}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", nargs="+", default=["aioserve", "vllm"], choices=["aioserve", "vllm"])
    parser.add_argument("--model", default=str(PEERS_HOME / "models" / "tiny-llama"))
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="lora-peers-"))
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        sys.exit(f"{model} not found: run ../shared/peers/setup.sh first (it writes the peers kit's models)")
    root = Path(args.out)
    adapters = [write_raw_adapter(model, root / f"adapter-{i}", 16, seed=i, scale=0.1) for i in range(args.adapters)]
    results = {}
    for peer in args.peers:
        if peer == "vllm" and not (PEERS_HOME / "venv-vllm" / "bin" / "vllm").exists():
            print("vllm: no venv in the peers kit, skipped")
            continue
        results[peer] = measure(peer, model, adapters, args)
        print(peer, json.dumps(results[peer]), flush=True)
    print(f"\n{model.name}, {args.requests} requests x {args.prompt_tokens} + {args.tokens} tokens, "
          f"concurrency {args.concurrency}, {args.adapters} rank-16 adapters (q/k/v/o/gate/up/down)\n")
    print("| server | ready s | base out tok/s | adapters out tok/s | vs own base | adapters vs vLLM |")
    print("|---|---|---|---|---|---|")
    vllm = results.get("vllm", {}).get("adapters")
    for peer, r in results.items():
        versus = f"{r['adapters'] / vllm:.2f}x" if vllm else "-"
        print(f"| {peer} | {r['ready_s']:.0f} | {r['base']:.0f} | {r['adapters']:.0f} | "
              f"{r['adapters'] / r['base']:.2f}x | {versus} |")


if __name__ == "__main__":
    main()
