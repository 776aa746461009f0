"""`aioserve serve --model PATH_OR_HF_ID [options]` (also `python -m aioserve serve`).

No option is written out here: they are built from the fields of EngineConfig
and ServerArgs (config.option), so the CLI cannot drift from the config.
Benchmarks and scripts reuse `add_options` / `engine_config` for the engine's
options, or `parse_serve_args` to check flags they pass to a server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

from aioserve.config import (
    DEMO_MODEL, GROUPS, UNSUPPORTED_FLAGS, ConfigError, EngineConfig, ServerArgs, parse_bytes,
)

__all__ = [
    "add_options", "build_parser", "engine_config", "main", "parse_bytes", "parse_serve_args", "serve_argv",
    "server_args",
]

Config = TypeVar("Config")


def option_fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """The CLI options of a config dataclass, each with its resolved type.
    A nested config (ServerArgs.engine) brings its own options and is skipped;
    any other field must be declared with config.option."""
    hints = typing.get_type_hints(cls)
    options = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with config.option(...)")
        options.append((f, hints[f.name]))
    return options


def flag(f: dataclasses.Field) -> str:
    name = f.name.replace("_", "-")
    return f"--disable-{name}" if f.default is True else f"--{name}"


def _value_type(kind: Any) -> type:
    """`int | None` -> int: what the option's text is converted to."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if len(args) != 1:
            raise TypeError(f"no CLI type for {kind}: give option(parse=...)")
        return args[0]
    return kind


def _reporting(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse prints an ArgumentTypeError's message but replaces a ValueError's
    with 'invalid <name> value'; keep the parser's own explanation."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__
    return convert


def add_options(parser: argparse.ArgumentParser, *classes: type) -> None:
    """Add the fields of config dataclasses to `parser` as options, in groups.
    Every option's dest is its field name."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}  # argparse hides empty groups
    for cls in classes:
        for f, kind in option_fields(cls):
            meta = f.metadata
            help_text = meta["help"].replace("%", "%%")  # argparse %-formats help
            kwargs: dict[str, Any] = {"dest": f.name}
            if kind is bool:
                kwargs.update(action="store_false" if f.default else "store_true", default=f.default)
            else:
                value_type = _value_type(kind)
                if meta.get("repeated"):  # list[str]: each flag adds its values
                    kwargs.update(action="extend", nargs="+")
                    value_type = typing.get_args(value_type)[0]
                kwargs["type"] = _reporting(meta["parse"]) if meta["parse"] else value_type
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
                if f.default is dataclasses.MISSING:
                    kwargs["required"] = True
                else:
                    kwargs["default"] = f.default
                    if f.default is not None:
                        help_text += " (default: %(default)s)"
            group = groups[meta["group"]]
            group.add_argument(flag(f), *meta.get("aliases", ()), help=help_text, **kwargs)
            for switch, value in meta.get("switches", {}).items():
                # SUPPRESS: the option's own action already set its default.
                group.add_argument(
                    switch, dest=f.name, action="store_const", const=value, default=argparse.SUPPRESS,
                    help=f"same as {flag(f)}" + ("" if kind is bool else f" {value}"),
                )


class _Unsupported(argparse.Action):
    """A flag of vLLM or SGLang whose feature aioserve lacks: a usage error that says why."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not supported: {self.reason}")


def add_unsupported(parser: argparse.ArgumentParser) -> None:
    from aioserve.models.registry import MODEL_CLASSES  # the families served, named where a refusal needs them

    architectures = ", ".join(sorted(name.removesuffix("ForCausalLM") for name in MODEL_CLASSES))
    group = parser.add_argument_group("not supported (vLLM and SGLang flags aioserve refuses, with the reason)")
    for name, takes_value, template in UNSUPPORTED_FLAGS:
        reason = template.format(architectures=architectures)
        group.add_argument(
            name, action=_Unsupported, reason=reason, nargs=None if takes_value else 0,
            dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=reason.replace("%", "%%"),
        )


def _build(cls: type[Config], ns: argparse.Namespace, **nested: Any) -> Config:
    return cls(**{f.name: getattr(ns, f.name) for f, _ in option_fields(cls)}, **nested)


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    """EngineConfig from a namespace parsed with add_options(parser, EngineConfig)."""
    return _build(EngineConfig, ns)


def server_args(ns: argparse.Namespace) -> ServerArgs:
    return _build(ServerArgs, ns, engine=engine_config(ns))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioserve", description="OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the HTTP server", description="Start the HTTP server.")
    # `vllm serve MODEL`'s spelling; --model (or SGLang's --model-path) names it too.
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model names it")
    add_options(serve, EngineConfig, ServerArgs)
    add_unsupported(serve)
    commands.add_parser(
        "build-kernels", help="build the native CPU kernels ahead of the first start",
        description="Build (or find in the cache) the C++ CPU kernels of native/ for this compiler and CPU, "
        "into $AIOSERVE_NATIVE_CACHE (default ~/.cache/aioserve/native). Needs g++ with OpenMP and ninja. "
        "Exits 1 when they cannot be built.",
    )
    return parser


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ServerArgs | None]:
    """argv -> the namespace and its ServerArgs (None for a command other than
    serve); a usage error (argparse's exit 2 with its message) for a bad flag
    or a bad combination of them."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command != "serve":
        return ns, None
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    positional = getattr(ns, "model_tag", None)
    if positional is not None:
        given = ns.model
        if given not in (DEMO_MODEL, positional):
            serve.error(f"the model is named twice: {positional!r} and --model {given!r}")
        ns.model = positional
    try:
        return ns, server_args(ns)
    except ValueError as exc:
        serve.error(str(exc))  # exits
        raise


def serve_argv(args: ServerArgs) -> list[str]:
    """The `aioserve serve` flags that give back `args` (parse_serve_args'
    inverse): the options that differ from their defaults. --dp starts its
    replicas with these."""
    argv: list[str] = []
    for config in (args.engine, args):
        for f, _ in option_fields(type(config)):
            value = getattr(config, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            if isinstance(value, bool):
                argv.append(flag(f))  # the flag that flips the default
            elif isinstance(value, list):
                argv += [f"{flag(f)}={item}" for item in value]  # a repeated option: one flag a value
            elif isinstance(value, dict):
                argv.append(f"{flag(f)}={json.dumps(value)}")  # as its parser reads it
            elif value is not None:
                argv.append(f"{flag(f)}={value}")  # one word: a value may start with "-"
    return argv


def parse_serve_args(argv: Sequence[str]) -> ServerArgs:
    """`aioserve serve` flags -> ServerArgs, exiting with argparse's message on
    a bad one: lets a script check flags before it starts a server with them."""
    args = _parse(["serve", *argv])[1]
    assert args is not None
    return args


def _wants_cpu_kernels(args: ServerArgs) -> bool:
    device = args.engine.device
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def prepare_native_kernels(args: ServerArgs) -> None:
    """Before the server listens: the native CPU kernels built or loaded
    (`build`), left to a background build (`background`), or turned off."""
    if args.native_kernels == "off":
        os.environ["AIOSERVE_NATIVE"] = "0"  # the engine's processes (TP ranks too) read it
    elif args.native_kernels == "build" and _wants_cpu_kernels(args):
        from aioserve.cpu.native import build_with_progress

        build_with_progress()


def build_kernels() -> int:
    from aioserve.cpu.native import build_with_progress, cache_root, enabled

    if not enabled():
        print("aioserve: AIOSERVE_NATIVE=0 (or no native/ sources): nothing to build", file=sys.stderr)
        return 1
    module = build_with_progress()
    if module is None:
        return 1
    print(f"aioserve: native CPU kernels ready: {module.library_path()} (cache: {cache_root()})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> None:
    ns, args = _parse(argv)
    level = getattr(ns, "log_level", "info")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if ns.command == "build-kernels":
        sys.exit(build_kernels())
    from aioserve.runtime import run_server

    assert args is not None
    prepare_native_kernels(args)
    if args.dp_size < 1:
        build_parser().error("--dp must be at least 1")
    if args.dp_size > 1:
        from aioserve.data_parallel import run_data_parallel

        sys.exit(run_data_parallel(args, serve_argv))
    try:
        run_server(args)
    except (FileNotFoundError, PermissionError) as exc:  # a model that cannot be had: the message says why
        logging.getLogger("aioserve").error("%s", exc)
        sys.exit(1)
    except ConfigError as exc:  # refused options, found as the engine loads: a usage error, no traceback
        print(f"aioserve serve: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
