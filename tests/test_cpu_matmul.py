"""The CPU matmul tuner (aioserve/cpu/matmul.py): whatever storage
order and form it picks, every layer computes x W^T, and a tied embedding
keeps embedding the same rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aioserve.cpu.matmul import FORMS, ROW_BUCKETS, MatmulChoice, choose, cpu_matmul, tune_cpu_matmuls
from aioserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aioserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear


def test_every_form_and_storage_order_computes_x_w_transposed() -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 96)
    for stored in (weight.contiguous(), weight.t().contiguous().t()):
        for rows in (1, 3, 16, 130):
            x = torch.randn(rows, 96)
            for name in FORMS:
                out = cpu_matmul(x, stored, MatmulChoice(False, {b: name for b in ROW_BUCKETS}))
                torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
                assert out.shape == (rows, 300)
                assert out.is_contiguous() or rows == 1  # later ops read rows


def test_choice_covers_every_bucket_and_maps_rows() -> None:
    choice = choose(torch.randn(64, 32))
    assert set(choice.forms) == set(ROW_BUCKETS) and set(choice.forms.values()) <= set(FORMS)
    assert choice.form_for(1) == choice.forms[1]
    assert choice.form_for(5) == choice.forms[16]
    assert choice.form_for(10_000) is None  # prefill: the untuned form


def test_tuning_reorders_weights_in_place_and_layers_agree() -> None:
    torch.manual_seed(1)
    embed = VocabParallelEmbedding(500, 64)
    embed.weight.data.normal_()
    head = ParallelLMHead(500, 64)
    head.tie_to(embed)
    mlp_up = MergedColumnParallelLinear(64, [128, 128])
    mlp_up.weight.data.normal_()
    down = RowParallelLinear(256, 64)
    down.weight.data.normal_()
    modules = [embed, head, mlp_up, down]
    ids = torch.tensor([3, 499, 0, 42])
    x, h = torch.randn(4, 64), torch.randn(4, 256)
    before = (embed(ids), head(x), mlp_up(x), down(h))
    weights_before = [m.weight.data.clone() for m in modules]
    choices = tune_cpu_matmuls([head, mlp_up, down])
    assert len(choices) == 3 and all(m.matmul_choice is not None for m in (head, mlp_up, down))
    assert head.weight is embed.weight  # still tied: one tensor, reordered at most once
    for module, weight in zip(modules, weights_before):
        assert torch.equal(module.weight.data, weight)  # same logical [out, in] values
    after = (embed(ids), head(x), mlp_up(x), down(h))
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_choices_are_kept_between_starts(tmp_path, monkeypatch) -> None:
    import aioserve.cpu.matmul as cpu_matmul_module

    path = tmp_path / "choices.json"
    monkeypatch.setenv("AIOSERVE_MATMUL_CACHE", str(path))
    path.write_text("{not json")  # a damaged file is ignored and replaced
    first = RowParallelLinear(64, 48)
    first.weight.data.normal_()
    chosen = tune_cpu_matmuls([first])
    assert path.exists() and len(chosen) == 1

    def no_timing(weight):
        raise AssertionError("a cached shape must not be timed again")

    monkeypatch.setattr(cpu_matmul_module, "choose", no_timing)
    second = RowParallelLinear(64, 48)
    second.weight.data.normal_()
    again = tune_cpu_matmuls([second])
    assert again == chosen and second.matmul_choice == first.matmul_choice


def test_a_very_large_weight_keeps_its_order(monkeypatch) -> None:
    """Past LARGE_WEIGHT_BYTES only the stored (row-major) order is timed."""
    import aioserve.cpu.matmul as cpu_matmul_module

    monkeypatch.setattr(cpu_matmul_module, "LARGE_WEIGHT_BYTES", 1024)
    choice = choose(torch.randn(64, 32))  # 8 KiB: "very large" here
    assert choice.column_major is False and set(choice.forms) == set(ROW_BUCKETS)
