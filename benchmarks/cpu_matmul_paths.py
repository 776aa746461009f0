"""One weight multiplied on each CPU matmul path, side by side in one process.

For Qwen3-0.6B's weight shapes in bf16 (or the shapes given), at each row
count: the packed kernel on the AMX tiles (where the CPU has them), the same
packed weight on the AVX512-BF16 pair dots (`use_matrix_tiles(False)`, what
AIOSERVE_AMX=0 does) and oneDNN's inner product on the weight reordered once
for it (`--cpu-matmul onednn`). Paths a CPU lacks are left out. The rounds
are interleaved and the best of each kept, since a shared machine's speed
drifts within minutes; each row also checks the paths agree with torch.

    python benchmarks/cpu_matmul_paths.py
    python benchmarks/cpu_matmul_paths.py --rows 1 64 --shapes 4096x1024 151936x1024
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioserve.cpu.matmul import onednn_packed_linear, onednn_reorder  # noqa: E402
from aioserve.cpu.native import cpu_kernels  # noqa: E402

QWEN3_SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                "lm_head": (151936, 1024)}


def best_seconds(paths: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    best = {name: float("inf") for name in paths}
    for name, run in paths.items():
        run()  # warm: first touch, oneDNN's kernel choice
    for _ in range(rounds):
        for name, run in paths.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="weights [N, K] (default: Qwen3-0.6B's)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, help="torch/OpenMP threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native kernels could not be built here")
    from aioserve.cpu.native_gemm import packs_bf16_pairs, use_matrix_tiles

    tiles = use_matrix_tiles(True)
    shapes = ({s: tuple(int(v) for v in s.lower().split("x")) for s in args.shapes} if args.shapes
              else QWEN3_SHAPES)
    packed_name = "pair dots" if packs_bf16_pairs() else "packed"  # the packed kernel's vector form
    names = (["tiles"] if tiles else []) + [packed_name, "oneDNN"]
    print(f"threads {torch.get_num_threads()}; AMX tiles {'in use' if tiles else 'absent'}; GFLOP/s (GB/s of weight)")
    print("| weight | rows | " + " | ".join(names) + " | worst error / scale |")
    print("|---|---|" + "---|" * len(names) + "---|")
    generator = torch.Generator().manual_seed(0)
    for label, (n, k) in shapes.items():
        weight = (torch.randn(n, k, generator=generator) * 0.02).bfloat16()
        packed = kernels.pack_linear_weight(weight)
        try:
            reordered: torch.Tensor | None = onednn_reorder(weight)
        except RuntimeError:
            reordered = None  # oneDNN cannot reorder bf16 on this CPU
        for rows in args.rows:
            x = torch.randn(rows, k, generator=generator).bfloat16()

            def packed_on(on_tiles: bool) -> Callable[[], torch.Tensor]:
                def run() -> torch.Tensor:
                    use_matrix_tiles(on_tiles)
                    return kernels.packed_linear(x, packed, None, n)
                return run

            paths: dict[str, Callable[[], torch.Tensor]] = {}
            if tiles:
                paths["tiles"] = packed_on(True)
            paths[packed_name] = packed_on(False)
            if reordered is not None:
                paths["oneDNN"] = lambda: onednn_packed_linear(x, reordered)
            seconds = best_seconds(paths, args.rounds)
            want = F.linear(x.float(), weight.float())
            scale = float(want.abs().max())
            worst = max(float((run().float() - want).abs().max()) for run in paths.values()) / scale
            flops, nbytes = 2 * rows * n * k, n * k * 2
            cells = [f"{flops / seconds[name] / 1e9:.0f} ({nbytes / seconds[name] / 1e9:.1f})" if name in seconds
                     else "-" for name in names]
            print(f"| {label} {n}x{k} | {rows} | " + " | ".join(cells) + f" | {worst:.1e} |", flush=True)
    use_matrix_tiles(True)


if __name__ == "__main__":
    main()
