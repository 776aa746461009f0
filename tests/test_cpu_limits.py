"""benchmarks/cpu_limits.py (issue 45's CPU roofline) kept from rotting: its
bound arithmetic on fixed numbers worked out by hand, the CPU description
from a fake flags set, and a run of the script on the demo model at tiny
sizes whose table and JSON must hold the expected rows. Its goals (80%,
50%, 60% of the machine's limits) are the benchmark's, never checked here:
a timed test on a shared machine would only be noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "cpu_limits.py"
sys.path.insert(0, str(SCRIPT.parent))

import cpu_limits  # noqa: E402  (benchmarks/ is no package)
from aioserve.cpu.dispatch import PERSONALITIES  # noqa: E402

# Qwen3-0.6B: 28 layers, hidden 1024, MLP 3072, 16 query and 8 KV heads of 128, 151,936 tokens, tied head.
QWEN3 = cpu_limits.Shape(28, 1024, 3072, 16, 8, 128, 151936, True)


def test_parameters_and_flops_of_qwen3() -> None:
    # q 2048 + k 1024 + v 1024 outputs of 1024, o 2048 -> 1024, gate/up/down 3 x 1024 x 3072
    assert QWEN3.layer_matmul_params() == 4_194_304 + 2_097_152 + 9_437_184
    assert QWEN3.matmul_params() == 28 * 15_728_640 + 151_936 * 1024 == 595_984_384
    # 2 x params x 64 rows + attention: 4 x 28 layers x 16 heads x 128 x 512 keys per row
    assert cpu_limits.decode_flops(QWEN3, 64, 512) == 2 * 595_984_384 * 64 + 64 * 117_440_512 == 83_802_193_920


def test_bytes_of_a_qwen3_decode_step() -> None:
    layers = 28 * (15_728_640 + 2 * 1024) * 2  # bf16 matmul weights and the two norms
    head, embedding_row = 151_936 * 1024 * 2, 1024 * 2
    kv = 512 * 28 * 2 * 8 * 128 * 2  # 512 tokens of bf16 K and V
    assert cpu_limits.decode_bytes(QWEN3, 1, 512, 2, 2) == layers + head + embedding_row + kv == 1_250_805_760
    # The greedy screen's float16 copy of a float32 head: the head read at 2 bytes, the rest at 4.
    narrow = cpu_limits.decode_bytes(QWEN3, 1, 512, 4, 2, head_itemsize=2)
    assert narrow == 28 * (15_728_640 + 2048) * 4 + head + 1024 * 4 + kv


def test_prefill_flops_count_causal_pairs_and_one_head_row_per_prompt() -> None:
    tiny = cpu_limits.Shape(1, 4, 8, 2, 1, 2, 10, True)
    assert tiny.layer_matmul_params() == 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8 == 144
    # 2 prompts x 3 tokens: layers 2 x 144 x 6, head 2 x 10 x 4 x 2 rows, attention 6 pairs a prompt (4 x 2 x 2 each)
    assert cpu_limits.prefill_flops(tiny, 2, 3) == 1728 + 160 + 2 * 4 * 2 * 2 * 6 == 2080


def test_fraction_is_bound_over_measured() -> None:
    assert cpu_limits.fraction(0.8, 1.0) == pytest.approx(0.8)
    assert cpu_limits.fraction(1.0, 0.0) == 0.0
    row = cpu_limits.Row("m", "decode b1", "decode b1", 10.0, 8.5, "bandwidth", 1, 1, "")
    assert row.fraction == pytest.approx(0.85) and row.goal == 0.80


def test_machine_description_from_fake_flags() -> None:
    cpuinfo = ("processor\t: 0\nmodel name\t: Fake Xeon 9999\nphysical id\t: 0\ncore id\t: 0\n\n"
               "processor\t: 1\nmodel name\t: Fake Xeon 9999\nphysical id\t: 0\ncore id\t: 0\n\n"
               "processor\t: 2\nmodel name\t: Fake Xeon 9999\nphysical id\t: 0\ncore id\t: 1\n")
    machine = cpu_limits.describe_machine(PERSONALITIES["amx"], cpuinfo)
    assert machine.cpu == "Fake Xeon 9999" and machine.cores == 2
    assert machine.flags == ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    assert cpu_limits.describe_machine(PERSONALITIES["avx2"], cpuinfo).flags == ["avx2", "fma", "f16c"]
    # float16's peak only where the CPU multiplies float16 natively
    assert cpu_limits.half_dtypes(PERSONALITIES["amx"]) == [torch.bfloat16, torch.float16]
    assert cpu_limits.half_dtypes(PERSONALITIES["avx512_bf16"]) == [torch.bfloat16]


def test_exclusive_timer_charges_children_to_their_own_category(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 3.0, 4.0])  # outer enters, inner enters, inner leaves, outer leaves
    monkeypatch.setattr(cpu_limits, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    timer = cpu_limits.ExclusiveTimer()
    with timer.section("attention"):
        with timer.section("matmul"):
            pass
    assert timer.totals == {"matmul": 2.0, "attention": 2.0}
    assert timer.shares() == {"matmul": 0.5, "attention": 0.5}


@pytest.mark.parametrize("forced", [[], ["--cpu-matmul", "blas"]], ids=["auto", "blas-forced"])
def test_quick_run_on_the_demo_model(tmp_path: Path, forced: list[str]) -> None:
    out = tmp_path / "limits.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "demo", "--quick", "--context", "32", "--large-batch", "4",
         "--prefill", "2", "16", "--bandwidth-mb", "8", "--matmul-shapes", "16x128x128", "--json", str(out), *forced],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    for line in ("| read bandwidth |", "| float32 matmul peak |", "| bfloat16 matmul peak |",
                 "| demo | decode b1 ctx32 |", "| demo | decode b4 ctx32 |", "| demo | prefill 2x16 |"):
        assert line in table, table
    assert "demo: math float32" in table  # the engine's cpu_dispatch lines
    # a forced path reaches the engine (the way to set two paths side by side)
    assert ("--cpu-matmul blas" in table) == bool(forced)
    report = json.loads(out.read_text())
    assert [r["step"] for r in report["rows"]] == ["decode b1 ctx32", "decode b4 ctx32", "prefill 2x16"]
    assert [r["goal"] for r in report["rows"]] == [0.80, 0.50, 0.60]
    for row in report["rows"]:
        assert row["measured_ms"] > 0 and row["bound_ms"] > 0 and row["fraction"] > 0
        # the bound comes from the limit measured beside the step; the start-of-run limits give the other fraction
        assert row["limit_beside"] > 0 and row["start_bound_ms"] > 0 and row["start_fraction"] > 0
        work = row["nbytes"] if row["bound_by"] == "bandwidth" else row["flops"]
        assert row["bound_ms"] == pytest.approx(work / row["limit_beside"] * 1e3)
    assert [r["bound_by"] for r in report["rows"]][0] == "bandwidth"  # batch 1: against bandwidth alone
    assert report["rows"][2]["bound_by"].endswith("matmul")
    assert report["machine"]["bandwidth"] > 0 and set(report["machine"]["matmul"]) >= {"float32", "bfloat16"}
    (breakdown,) = report["breakdown"]
    assert breakdown["batch"] == 4 and {"matmul", "attention", "norms"} <= set(breakdown["shares"])
    assert sum(breakdown["shares"].values()) == pytest.approx(1.0)


def test_matmul_paths_benchmark_prints_each_path_agreeing_with_torch() -> None:
    """benchmarks/cpu_matmul_paths.py: a row per weight and row count, a
    column per path this CPU has, every path checked against torch."""
    script = REPO / "benchmarks" / "cpu_matmul_paths.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), "--rows", "1", "5", "--shapes", "96x64", "--rounds", "1"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 96x64 96x64 |")]
    assert [line.split("|")[2].strip() for line in lines] == ["1", "5"]
    for line in lines:
        assert float(line.rstrip(" |").rsplit("|", 1)[1]) < 2e-2  # worst error / scale: bf16 rounding
