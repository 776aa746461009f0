"""Which (M, K, N) torch's block-scaled FP8 matmul (cuBLASLt on Hopper) takes,
with the operands `block_fp8_linear` builds, its padding of M to a multiple
of 4 turned off (the probe measures cuBLASLt, not the padding). Run on the GPU machine:
    python tools/gpu/probe_block_fp8.py > $OUT/probe.txt
Prints one line per (scale layout, K, N): the M that ran (and their worst relative error
against the dequantised product) and the M that raised."""

from __future__ import annotations

import torch

from aioserve.quant import fp8_block_linear
from aioserve.quant.fp8_block_linear import BLOCK, block_fp8_linear, quantize_blocks, scale_columns

ROWS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 32, 33, 64, 128, 256)


def probe(k: int, n: int, q: torch.Tensor, held: torch.Tensor, wide: torch.Tensor, layout: str,
          device: torch.device) -> None:
    """One line: the M that ran (worst error against the dequantised product) and the M that raised."""
    ran, raised, worst = [], {}, 0.0
    for m in ROWS:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        try:
            got = block_fp8_linear(x.to(device), q.to(device), held.to(device), None).float().cpu()
        except (RuntimeError, ValueError, NotImplementedError) as error:
            raised[m] = str(error).split("\n")[0][:60]
            continue
        exact = x.float() @ wide.t()
        worst = max(worst, ((got - exact).abs().max() / exact.abs().max()).item())
        ran.append(m)
    kinds = sorted(set(raised.values()))
    print(f"{layout:5s} K={k:5d} N={n:5d} ran M={ran} err<={worst:.3f} raised M={sorted(raised)} {kinds}")


def main() -> None:
    fp8_block_linear.CUBLAS_ROW_MULTIPLE = 1  # every M reaches cuBLASLt as it is
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run of the wiring
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0) if device.type == "cuda" else "no GPU")
    for k in (128, 256, 384, 512, 1024, 4096):
        for n in (128, 256, 384, 1024, 4096):
            torch.manual_seed(k + n)
            q, scale = quantize_blocks(torch.randn(n, k) * 0.05)
            wide = (q.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * scale[:, None, :, None]).reshape(n, k)
            for layout in ("L4", "exact"):  # scales' columns padded to a multiple of 4, or K/128 as they come
                columns = scale_columns(scale.shape[1]) if layout == "L4" else scale.shape[1]
                held = torch.ones(scale.shape[0], columns)
                held[:, : scale.shape[1]] = scale
                probe(k, n, q, held, wide, layout, device)


if __name__ == "__main__":
    main()
