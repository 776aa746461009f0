"""The CLI is built from the config dataclasses: every field is an option,
defaults and meanings match the dataclasses, bad values are argparse errors,
and the benchmarks take the same options."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aioserve.attention import BACKENDS
from aioserve.cli import add_options, build_parser, engine_config, parse_serve_args, server_args
from aioserve.config import ATTENTION_BACKENDS, DEMO_MODEL, GROUPS, EngineConfig, ServerArgs, option, parse_bytes

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def option_fields() -> list[dataclasses.Field]:
    return [f for cls in (EngineConfig, ServerArgs) for f in dataclasses.fields(cls) if f.name != "engine"]


def test_every_field_is_an_option_with_help() -> None:
    by_dest: dict[str, argparse.Action] = {}
    for action in serve_parser()._actions:  # the option's own action comes before its switches
        by_dest.setdefault(action.dest, action)
    for f in option_fields():
        action = by_dest[f.name]
        kebab = f.name.replace("_", "-")
        main = f"--disable-{kebab}" if f.default is True else f"--{kebab}"
        assert action.option_strings == [main, *f.metadata["aliases"]]
        assert action.help and f.metadata["group"] in GROUPS
    assert not by_dest["model"].required and by_dest["model"].default == DEMO_MODEL
    assert "--disable-overlap" in by_dest["overlap"].option_strings
    assert by_dest["tp_size"].option_strings == ["--tp-size", "--tp", "--tensor-parallel-size"]


def test_defaults_equal_the_dataclasses() -> None:
    assert parse_serve_args(["--model", "x"]) == ServerArgs(engine=EngineConfig(model="x"))


def test_no_model_means_the_built_in_one() -> None:
    args = parse_serve_args([])
    assert args == ServerArgs(engine=EngineConfig()) and args.engine.model == DEMO_MODEL
    assert args.model_name == DEMO_MODEL and args.engine.revision is None
    assert parse_serve_args(["--model", "org/m", "--revision", "v2"]).engine.revision == "v2"


def test_flags_round_trip() -> None:
    args = parse_serve_args([
        "--model", "m", "--disable-overlap", "--kv-cache-memory", "512MiB", "--num-pages", "20",
        "--served-model-name", "name", "--debug-integrity", "--gpu-memory-utilization", "0.5",
        "--cache", "naive", "--api-key", "k", "--log-level", "debug", "--port", "9000",
    ])
    engine = args.engine
    assert (engine.overlap, engine.kv_cache_memory, engine.num_pages) == (False, 536870912, 20)
    assert (engine.debug_integrity, engine.mem_fraction_static, engine.cache) == (True, 0.5, "naive")
    assert (args.served_model_name, args.model_name, args.api_key, args.log_level, args.port) == (
        "name", "name", "k", "debug", 9000,
    )


def test_help_lists_groups_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for heading in GROUPS:
        assert f"\n{heading}:\n" in out
    assert "tokens per KV page (default: 16)" in out
    assert "--disable-overlap" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--page-size", "abc"], "invalid int value"),
        (["--cache", "bogus"], "invalid choice"),
        (["--kv-cache-memory", "lots"], "not a size"),
        (["--attention-backend", "flash"], "invalid choice"),
    ],
)
def test_bad_values_are_argparse_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--model", "m", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_attention_choices_match_the_backends() -> None:
    assert ATTENTION_BACKENDS == BACKENDS


def test_parse_bytes() -> None:
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("1e9") == 10**9
    for bad in ("abc", "1.2.3", "4XB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_a_new_field_is_a_new_option_and_a_bare_field_is_refused() -> None:
    @dataclasses.dataclass
    class Extra:
        ratio: float | None = option(None, help="a ratio", group="scheduling")
        fast: bool = option(True, help="slow path", group="scheduling")

    parser = argparse.ArgumentParser()
    add_options(parser, Extra)
    assert vars(parser.parse_args(["--ratio", "0.5", "--disable-fast"])) == {"ratio": 0.5, "fast": False}

    @dataclasses.dataclass
    class Bare:
        knob: int = 1

    with pytest.raises(TypeError, match="Bare.knob"):
        add_options(argparse.ArgumentParser(), Bare)


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_benchmark_takes_the_engine_options(monkeypatch: pytest.MonkeyPatch) -> None:
    offline = load_script("offline")
    for spelling in ("--disable-overlap", "--no-overlap"):  # --no-overlap: the script's older flag
        argv = ["offline.py", "--model", "m", "--num-prompts", "3", spelling, "--kv-cache-memory", "1GiB", "--seed", "5"]
        monkeypatch.setattr(sys, "argv", argv)
        args = offline.parse_args()
        assert args.num_prompts == 3 and args.seed == 5
        assert engine_config(args) == EngineConfig(model="m", overlap=False, kv_cache_memory=1 << 30, seed=5)


@pytest.mark.parametrize("name", ["serving_sweep", "prefix_and_chunking"])
def test_server_benchmarks_pass_serve_flags_through(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = load_script(name)
    argv = [f"{name}.py", "--model", "m", "--server-args", "--cache naive", "--load-format", "dummy", "--dtype=bf16"]
    monkeypatch.setattr(sys, "argv", argv)
    assert script.parse_args().serve_flags == ["--cache", "naive", "--load-format", "dummy", "--dtype=bf16"]
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--model", "m", "--page-size", "abc"])
    with pytest.raises(SystemExit) as exit_:
        script.parse_args()
    assert exit_.value.code == 2 and "--page-size" in capsys.readouterr().err


def test_server_args_builds_both_dataclasses() -> None:
    ns = build_parser().parse_args(["serve", "--model", "m", "--host", "0.0.0.0", "--page-size", "32"])
    args = server_args(ns)
    assert args.host == "0.0.0.0" and args.engine.page_size == 32 and args.engine.model == "m"
