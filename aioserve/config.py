"""Every knob in one place: EngineConfig (model, memory, scheduling) and
ServerArgs (HTTP on top of it). The CLI and the offline API both fill these.

Each field is declared with `option(...)`, which carries its help text, its
CLI group and, where free text is not enough, choices or a parser. cli.py
builds `aioserve serve`'s options from the fields, so a new knob is one field
here and nothing else."""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

DEFAULT_CPU_KV_BYTES = 4 << 30
DEFAULT_MAX_REQUEST_BYTES = 16 << 20

# CLI argument groups, in the order `aioserve serve --help` lists them.
GROUPS = ("model", "KV cache", "scheduling", "speculative decoding", "LoRA", "images", "distributed", "HTTP")

# Equals aioserve.attention.BACKENDS (tests/test_cli.py checks it). Spelled out
# because importing it would make this leaf module, which everything imports,
# pull in torch and the attention package.
ATTENTION_BACKENDS = ("auto", "torch_native", "flashinfer")

LORA_DTYPES = ("auto", "bfloat16", "float16", "float32")  # vLLM's --lora-dtype choices, and float32


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object; a usage error that says so when it is not one."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


# What --limit-mm-per-prompt names (vLLM's modalities); aioserve takes images only.
MODALITIES = ("image", "video", "audio")
DEFAULT_IMAGES_PER_PROMPT = 16


def _modality_limits(text: str) -> dict[str, Any]:
    """vLLM's --limit-mm-per-prompt: a JSON object ('{"image": 4}', a
    modality's value a count or vLLM's newer {"count": 4, ...}), or its
    older spelling image=4,video=0."""
    import argparse

    if text.lstrip().startswith("{"):
        return _json_object(text)
    limits: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = pair.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected a JSON object or MODALITY=COUNT pairs, got {pair!r}")
        limits[name.strip()] = int(value)
    return limits


def images_per_prompt(limits: dict[str, Any] | None) -> int:
    """The image count of a --limit-mm-per-prompt value; a ValueError (a
    usage error) for a modality aioserve does not take or a bad count."""
    limits = limits or {}
    counts: dict[str, int] = {}
    for name, value in limits.items():
        if name not in MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {name!r} (vLLM's are {', '.join(MODALITIES)})")
        count = value.get("count") if isinstance(value, dict) else value
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {name} needs a count of 0 or more, got {value!r}")
        counts[name] = count
    if any(counts.get(name, 0) for name in MODALITIES if name != "image"):
        raise ValueError("--limit-mm-per-prompt: aioserve takes images only; video and audio may only be 0")
    return counts.get("image", DEFAULT_IMAGES_PER_PROMPT)


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([\d.e+]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    try:
        number = float(match.group(1)) if match else None
    except ValueError:  # '1.2.3' passes the pattern
        number = None
    if match is None or number is None:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    return int(number * 1024 ** "_kmgt".index(match.group(2) or "_"))


def option(
    default: Any = MISSING,
    *,
    help: str,
    group: str,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    aliases: tuple[str, ...] = (),
    switches: dict[str, Any] | None = None,
    repeated: bool = False,
) -> Any:
    """A dataclass field that is also a CLI option: `--kebab-name` from the
    field name, type from the annotation unless `parse` turns the text into the
    value, required when there is no default. A bool that defaults to True is
    offered as `--disable-kebab-name`, one that defaults to False as a switch;
    either way `help` says what the flag does. `aliases` are further flags for
    the same option (the spellings users of other servers type); `switches`
    are flags without a value that set the option to theirs (vLLM's
    `--no-enable-prefix-caching` is `--cache naive`). `repeated`: a list
    option, each flag giving one or more values (`--lora-modules a=x b=y`)."""
    if group not in GROUPS:
        raise ValueError(f"unknown option group {group!r} (choose from {', '.join(GROUPS)})")
    return field(
        default=default, metadata={
            "help": help, "group": group, "choices": choices, "parse": parse, "aliases": aliases,
            "switches": switches or {}, "repeated": repeated,
        },
    )


# The model `aioserve serve` runs without --model: stories260K, shipped inside
# the package (aioserve/demo_model), so a fresh install answers with nothing
# downloaded. models/source.py maps the name to the folder.
DEMO_MODEL = "stories260K"


class ConfigError(ValueError):
    """An option, or a combination of them, that cannot be served here (found
    while the engine loads: the device, the checkpoint or the memory decide
    it). The CLI prints the message as a usage error, not a traceback."""


@dataclass
class EngineConfig:
    model: str = option(
        DEMO_MODEL, group="model", aliases=("--model-path",),
        help="a local Hugging Face folder, a Hugging Face model id (fetched into the hub cache, HF_HOME), or "
        f"{DEMO_MODEL}: the 260K-parameter demo model built into the package",
    )
    revision: str | None = option(
        None, group="model", help="branch, tag or commit of a Hugging Face model id (default: main)"
    )
    tokenizer: str | None = option(None, help="tokenizer folder (default: the model's)", group="model")
    dtype: str = option("auto", help="auto | float32 | bfloat16 | float16", group="model")
    cpu_half_compute: str = option(
        "auto", group="model", choices=("auto", "native", "float32"),
        help="half-precision math on CPU: native, or float32 with rounded weights (auto: float32 unless the CPU "
        "has AVX512-BF16/AMX); see engine/dtypes.py",
    )
    device: str = option("auto", help="auto | cpu | cuda | cuda:N", group="model")
    load_format: str = option(
        "auto", choices=("auto", "safetensors", "dummy"), group="model",
        help="dummy: random weights of the config's shapes",
    )
    seed: int = option(0, help="for dummy weights and unseeded sampling", group="model")
    runner: str = option(
        "auto", choices=("auto", "generate", "pooling"), group="model", switches={"--is-embedding": "pooling"},
        help="pooling: serve the model as an embedder (/v1/embeddings) or, for a *ForSequenceClassification "
        "checkpoint, a reranker (/v1/rerank, /v1/score); auto: pooling for a sentence-transformers folder or a "
        "classifier, else generate (SGLang: --is-embedding)",
    )
    pooler_config: dict[str, Any] | None = option(
        None, group="model", parse=_json_object,
        help='a pooling model\'s pooling, over what its folder says, e.g. \'{"pooling_type": "MEAN", '
        '"normalize": true}\' (pooling_type LAST | MEAN | CLS); implies --runner pooling',
    )

    cpu_matmul: str = option(
        "auto", group="model", choices=("auto", "native", "onednn", "blas"),
        help="how CPU weights are multiplied: native (packed once for aioserve's kernels; bf16 on AMX tiles where "
        "the CPU has them), onednn (reordered once into oneDNN's layout, its inner product), blas (torch's matmul, "
        "forms timed per shape); auto: native, or for float16 math on AMX the faster of oneDNN's layout and the "
        "BLAS forms per weight shape",
    )
    cpu_matmul_tuning: bool = option(
        True, group="model",
        help="on CPU, time each weight shape's matmul forms and storage orders at load and use the fastest "
        "(about a second; --disable-cpu-matmul-tuning keeps one fixed form)",
    )

    page_size: int = option(16, help="tokens per KV page", group="KV cache")
    num_pages: int | None = option(None, help="KV pool size in pages (overrides the memory budget)", group="KV cache")
    kv_cache_memory: int | None = option(
        None, parse=parse_bytes, group="KV cache",
        help="KV pool bytes on CPU, e.g. 4GiB (default: 4GiB, capped by what the requests could use); "
        "written at startup, so the server's RSS holds the whole pool from the start",
    )
    mem_fraction_static: float = option(
        0.85, group="KV cache", aliases=("--gpu-memory-utilization",),
        help="share of the GPU's total memory for the weights and the KV pool; the pool gets what the weights "
        "leave of it, and activations and CUDA graphs live in the rest",
    )
    kv_cache_dtype: str = option(
        "auto", group="KV cache",
        help="auto | float32 | bfloat16 | float16 | fp8_e4m3 (auto: the weights' dtype when --dtype is given, else "
        "the math's; fp8_e4m3, alias fp8: half a 16-bit cache's memory and reads, values saturated at +-448, no scales)",
    )
    cache: str = option(
        "radix", choices=("radix", "naive"), help="prefix cache", group="KV cache",
        switches={
            "--enable-prefix-caching": "radix", "--no-enable-prefix-caching": "naive", "--disable-radix-cache": "naive",
        },
    )

    max_model_len: int | None = option(
        None, help="context limit (default: the model's)", group="scheduling", aliases=("--context-length",)
    )
    max_running_requests: int = option(
        256, help="requests decoding at once (page-table slots)", group="scheduling", aliases=("--max-num-seqs",)
    )
    max_prefill_tokens: int | None = option(
        None, group="scheduling", aliases=("--max-num-batched-tokens", "--chunked-prefill-size"),
        help="prefill tokens per step; longer prompts are chunked (default: 8192 on GPU; 1024 on CPU, where "
        "prefill is compute-bound: chunks give a burst's first requests their first token sooner, and 1024 rows "
        "keep the matmuls near their peak)",
    )
    decode_reserve_tokens: int = option(
        64, help="KV room a request must have beyond its prompt to be admitted", group="scheduling"
    )
    overlap: bool = option(
        True, help="plain sequential loop instead of preparing step N+1 while step N runs", group="scheduling"
    )
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS, group="scheduling",
        help="attention kernels: flashinfer (CUDA, the gpu extra), torch_native (CPU and CUDA, the reference); "
        "auto takes flashinfer on CUDA when it imports",
    )
    cuda_graph: bool = option(
        True, group="scheduling",
        help="run decode-only steps eagerly through the modules: no captured CUDA graph on a GPU (graphs need "
        "the flashinfer backend), no native whole-step call (DecoderStack) on a CPU",
        aliases=("--enforce-eager",),
    )
    cuda_graph_max_bs: int = option(
        256, group="scheduling",
        help="largest decode batch with a CUDA graph (captured sizes: 1, 2, 4, 8, then every 8); larger "
        "batches run eagerly",
    )
    num_threads: int | None = option(None, help="torch intra-op threads on CPU", group="scheduling")
    debug_integrity: bool = option(
        False, help="check the KV bookkeeping whenever the scheduler goes idle", group="scheduling"
    )

    speculative_config: dict[str, Any] | None = option(
        None, group="speculative decoding", parse=_json_object,
        help='vLLM\'s JSON object, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}\', {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} or {"method": "eagle3", "model": HEAD_PATH}: propose tokens and verify them in one forward '
        "(lossless: the outputs are the model's own); see docs/guide/speculative.md",
    )
    speculative_algorithm: str | None = option(
        None, group="speculative decoding",
        help="SGLang's spelling of the method: NGRAM (prompt lookup), STANDALONE (a draft model: "
        "--speculative-draft-model-path) or EAGLE3 (an EAGLE-3 head: the same flag); with --speculative-num-draft-tokens N "
        "(N - 1 tokens proposed a step) or --speculative-num-steps K (K proposed)",
    )
    speculative_draft_model_path: str | None = option(
        None, group="speculative decoding",
        help="SGLang's draft model flag: the draft's checkpoint for STANDALONE (same vocabulary as the target), "
        "the EAGLE-3 head's for EAGLE3 (trained for this target)",
    )
    speculative_num_draft_tokens: int | None = option(
        None, group="speculative decoding", help="SGLang's count: tokens verified a step, the proposed ones plus one"
    )
    speculative_num_steps: int | None = option(
        None, group="speculative decoding", help="SGLang's count: tokens proposed a step"
    )

    enable_lora: bool = option(
        False, group="LoRA",
        help="serve LoRA adapters (PEFT folders) over the base model: a request's `model` names its adapter, "
        "and one batch mixes adapters and the base; see docs/guide/lora.md",
    )
    lora_modules: list[str] | None = option(
        None, group="LoRA", repeated=True, aliases=("--lora-paths",),
        help="adapters loaded at start, each NAME=PATH or vLLM's JSON object "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (SGLang\'s --lora-paths also takes a bare PATH, '
        "named by itself); implies --enable-lora",
    )
    max_loras: int = option(
        4, group="LoRA", aliases=("--max-loras-per-batch",),
        help="adapters one step can use at once: the slots held next to the weights (more adapters wait in host "
        "memory and take a slot freed by the least recently used)",
    )
    max_lora_rank: int = option(
        16, group="LoRA", help="the largest adapter rank served (slots are sized for it; a larger one is refused)"
    )
    max_cpu_loras: int | None = option(
        None, group="LoRA",
        help="adapters kept read in host memory, least recently used first out (read again from their folder "
        "when next used); default: every loaded adapter",
    )
    lora_dtype: str = option(
        "auto", choices=LORA_DTYPES, group="LoRA",
        help="the adapters' weights rounded to this dtype (auto: the base model's); narrower than the math, the "
        "CPU's native update reads them at that width (a float32 model's 16 rank-16 adapters: half the bytes a "
        "step), the math staying the model's",
    )

    tp_size: int = option(
        1, aliases=("--tp", "--tensor-parallel-size"), group="distributed",
        help="tensor-parallel ranks: one process each, rank 0 serving HTTP (one GPU each on CUDA, NCCL; on CPU "
        "gloo, each rank with its share of the cores); heads, MLP and vocabulary are split over them",
    )
    nnodes: int = option(
        1, group="distributed",
        help="machines the ranks are spread over (--tp / --nnodes each); start `aioserve serve` with the same "
        "options on every machine, each with its --node-rank",
    )
    node_rank: int = option(0, help="this machine's index among --nnodes (0 serves HTTP)", group="distributed")
    dist_init_addr: str | None = option(
        None, group="distributed",
        help="HOST:PORT of node 0 where the ranks meet (default: a free local port; needed with --nnodes > 1); "
        "ranks give up meeting after AIOSERVE_DIST_INIT_TIMEOUT seconds (default 120)",
    )

    def __post_init__(self) -> None:
        """Sizes that must be positive (the CLI reports these as usage errors)."""
        for flag, value in (("--page-size", self.page_size), ("--max-running-requests", self.max_running_requests),
                            ("--max-prefill-tokens", self.max_prefill_tokens), ("--tp", self.tp_size),
                            ("--cuda-graph-max-bs", self.cuda_graph_max_bs), ("--num-threads", self.num_threads),
                            ("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank),
                            ("--max-cpu-loras", self.max_cpu_loras)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")

# Spelled out: config imports nothing of the project; tests/test_router.py
# checks them against sglang-router's --policy choices.
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


# Flags of vLLM and SGLang whose feature aioserve does not have: the CLI knows
# them so that it can say why, instead of argparse's "unrecognized arguments".
# Each: (the flag, whether it takes a value, why aioserve refuses it; the CLI
# fills {architectures} from the model registry).
UNSUPPORTED_FLAGS: tuple[tuple[str, bool, str], ...] = (
    (
        "--trust-remote-code", False,
        "aioserve never runs Python code shipped with a model: it serves only the architectures it implements "
        "itself ({architectures}), none of which needs remote code; drop the flag",
    ),
)


@dataclass
class ServerArgs:
    engine: EngineConfig  # its options come from its own fields
    host: str = option("127.0.0.1", help="address to listen on", group="HTTP")
    port: int = option(8000, help="port to listen on", group="HTTP")
    served_model_name: str | None = option(None, help="the name clients use (default: --model)", group="model")
    chat_template: str | None = option(
        None, help="a Jinja file that replaces the tokenizer's chat template", group="model"
    )
    default_chat_template_kwargs: dict[str, Any] | None = option(
        None, group="model", parse=_json_object,
        help='JSON object of chat template arguments every chat request starts from (vLLM\'s flag), e.g. '
        '\'{"enable_thinking": false}\'; a request\'s chat_template_kwargs win',
    )
    # Spelled out: config imports nothing of the project; tests/test_tool_parsers.py
    # checks them against aioserve.server.output.tool_parsers.CHOICES and server.output.reasoning.PARSERS.
    tool_call_parser: str = option(
        "auto", group="model",
        choices=(
            "auto", "none", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "qwen", "qwen3", "qwen25",
            "llama3", "llama", "llama4_pythonic", "qwen3_xml",
        ),
        help="how the model writes tool calls: hermes (Qwen's <tool_call>{json}</tool_call>), llama3_json "
        '({"name": ..., "parameters": ...}), mistral ([TOOL_CALLS]...), pythonic ([f(x=1)], Llama 3.2/4), '
        "qwen3_coder (Qwen3-Coder's <function=...><parameter=...> XML), none, or auto: the format the chat "
        "template teaches",
    )
    reasoning_parser: str | None = option(
        None, group="model", choices=("qwen3", "deepseek_r1"),
        help="split a thinking model's <think>...</think> into reasoning_content (default: no split)",
    )
    enable_reasoning: bool = option(
        False, group="model",
        help="vLLM before 0.10: reasoning is split whenever --reasoning-parser names a parser, which this "
        "switch requires (as vLLM did)",
    )
    auto_tool_choice: bool = option(
        True, group="model", switches={"--enable-auto-tool-choice": True},
        help='answer tool_choice "auto" with a 400, as vLLM does without --enable-auto-tool-choice '
        "(which is aioserve's default)",
    )
    generation_config: str = option(
        "auto", group="model",
        help="where a request's unset sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) "
        "take their defaults from: auto (the model's generation_config.json), vllm or none "
        "(aioserve's neutral defaults), or a folder holding a generation_config.json",
    )
    allowed_origins: str | None = option(
        None, group="HTTP",
        help="comma-separated origins allowed by CORS (browser pages served elsewhere), or *",
    )
    api_key: str | None = option(
        None, group="HTTP",
        help="require `Authorization: Bearer KEY` on every route but /health, /metrics, the chat page, /docs "
        "and /openapi.json (default: $AIOSERVE_API_KEY)",
    )
    tokenizer_workers: int = option(4, help="threads that tokenize requests", group="HTTP")
    dp_size: int = option(
        1, aliases=("--dp", "--data-parallel-size"), group="distributed",
        help="replicas of the whole server (each with its --tp ranks) on this machine, on loopback ports from "
        "--dp-base-port, behind sglang-router on --host/--port (the router extra: pip install "
        "'aioserve[router]'); a replica that exits is restarted, the router routes around it meanwhile",
    )
    dp_base_port: int | None = option(
        None, group="distributed",
        help="with --dp: replica i listens on 127.0.0.1 at this port + i (default: --port + 1)",
    )
    dp_metrics_port: int | None = option(
        None, group="distributed",
        help="with --dp: every replica's /metrics merged (a replica label on each sample) at this port on --host "
        "(default: the port after the last replica's)",
    )
    router_policy: str = option(
        "cache_aware", choices=ROUTER_POLICIES, group="distributed",
        help="with --dp: how the router picks a replica; cache_aware sends a prompt to the replica whose "
        "requests shared the longest prefix with it (its radix cache likely holds it), the least loaded one "
        "when the load is uneven",
    )
    router_args: str | None = option(
        None, group="distributed",
        help="with --dp: further sglang-router flags in one string, e.g. --router-args='--prometheus-port 29001' "
        "(the = keeps a lone flag from being read as aioserve's); they come last, so they override aioserve's "
        "(python -m sglang_router.launch_router --help lists them)",
    )
    native_kernels: str = option(
        "build", group="model", choices=("build", "background", "off"),
        help="the C++ CPU kernels (native/, about 15 s to build once per machine, then cached): build "
        "(or load) them before listening; background: listen at once, torch fallbacks serving (slower) until "
        "the build is done; off: torch fallbacks only (as AIOSERVE_NATIVE=0). Not needed on CUDA",
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, parse=parse_bytes, group="HTTP",
        help="larger request bodies get 413 before they are read (a 128K-token prompt is well under 1 MiB "
        "of text)",
    )
    max_waiting_requests: int | None = option(
        None, group="scheduling", aliases=("--max-queued-requests",),
        help="past this many requests waiting for admission, new ones get 429 with Retry-After at once "
        "(default: no bound)",
    )
    shutdown_timeout: float = option(
        30.0, group="HTTP",
        help="on SIGTERM/SIGINT, seconds running requests get to finish before the rest are aborted "
        "(new requests get 503 meanwhile; a second signal exits at once)",
    )
    ssl_keyfile: str | None = option(None, help="the TLS private key (PEM), with --ssl-certfile: serve HTTPS", group="HTTP")
    ssl_certfile: str | None = option(None, help="the TLS certificate chain (PEM), with --ssl-keyfile", group="HTTP")
    backlog: int = option(
        2048, group="HTTP",
        help="connections the kernel queues for accepting (listen backlog; capped by net.core.somaxconn): "
        "past it, a burst's connections are refused or reset",
    )
    request_body_timeout: float = option(
        30.0, group="HTTP",
        help="seconds a request body may stall (nothing arriving) before the request gets 408 and its "
        "connection is closed",
    )
    request_body_deadline: float = option(
        120.0, group="HTTP",
        help="seconds a whole request body may take to arrive, however steadily it trickles in (408 and the "
        "connection closed past it)",
    )
    # Bounds on one request (server/body/checks.py), checked on the parsed JSON
    # before it is validated or any work is built; each a 400 naming its option.
    max_choices_per_request: int = option(
        1024, group="HTTP",
        help="prompts × n one request may ask for (each choice is a generation of its own)",
    )
    max_messages_per_request: int = option(4096, help="chat messages in one request", group="HTTP")
    max_token_ids_per_request: int = option(
        262144, group="HTTP",
        help="token ids in one request's prompts (and in stop_token_ids, /detokenize's tokens)",
    )
    max_logit_bias_entries: int = option(1024, help="logit_bias entries in one request", group="HTTP")
    max_stop_sequences: int = option(16, help="stop strings in one request", group="HTTP")
    max_tools_per_request: int = option(128, help="tools in one chat request (OpenAI's limit)", group="HTTP")
    max_logprob_entries_per_request: int = option(
        1 << 20, group="HTTP",
        help="logprob entries one response may hold, estimated before any work: prompts × n × (echoed prompt + "
        "max_tokens) × (1 + top logprobs), a prompt's tokens counted as its characters",
    )
    max_response_tokens_per_request: int = option(
        1 << 22, group="HTTP",
        help="tokens of text one response may hold, estimated before any work: prompts × n × (echoed prompt + "
        "max_tokens), a prompt's tokens counted as its characters and each choice's max_tokens capped at the "
        "context (a chat request without one counts the context). 4,194,304 by default: ~16 MB of text",
    )
    max_grammar_chars: int = option(
        128 << 10, group="HTTP",
        help="characters of the grammar text one constraint compiles from (a JSON schema, a regex, an EBNF, "
        "the choices' grammar): past it a 400 before compiling",
    )
    grammar_compile_timeout: float = option(
        20.0, group="HTTP",
        help="seconds a request waits for its grammar to compile (on workers of their own) before its 400; the "
        "compile finishes and is cached",
    )
    max_json_depth: int = option(
        64, group="HTTP", help="nesting of objects and arrays in a request body (a JSON schema, chat_template_kwargs)"
    )
    max_json_values: int = option(
        65536, group="HTTP",
        help="values in a request body's objects and arrays, token-id lists aside (bounded by "
        "--max-token-ids-per-request): what validating it costs the event loop",
    )
    # Images in prompts (a vision-language model: aioserve/images), vLLM's spellings.
    limit_mm_per_prompt: dict[str, Any] | None = option(
        None, group="images", parse=_modality_limits,
        help=f'images one prompt may hold, vLLM\'s JSON object, e.g. \'{{"image": 4}}\' (its older image=4 too; '
        f"video and audio may only be 0); default {DEFAULT_IMAGES_PER_PROMPT} images",
    )
    allowed_local_media_path: str | None = option(
        None, group="images",
        help="a folder whose image files requests may name (file:// URLs or absolute paths), symlinks resolved "
        "and none outside it (default: no local files)",
    )
    media_fetch_timeout: float = option(
        5.0, group="images",
        help="seconds an image URL gets to be fetched whole, redirects included (vLLM: VLLM_IMAGE_FETCH_TIMEOUT)",
    )
    max_image_bytes: int = option(
        20 << 20, parse=parse_bytes, group="images",
        help="the largest image file taken, fetched, inline (a data URL) or local; data URLs count toward "
        "--max-request-bytes too",
    )
    max_image_pixels: int = option(
        50_000_000, group="images",
        help="the most pixels an image may have, read from its header before it is decoded (a decompression "
        "bomb, a GIF of huge logical size, is refused unread)",
    )
    allow_private_media_urls: bool = option(
        False, group="images",
        help="fetch image URLs whose host is a private, loopback or link-local address (refused by default, "
        "on every redirect too: a request must not reach the server's own network)",
    )
    log_level: str = option("info", choices=("debug", "info", "warning", "error"), help="logging level", group="HTTP")
    access_log: bool = option(
        False, group="HTTP",
        help="log every HTTP request (client, method, path, status) at info level, through the logger "
        "hypercorn.access: what a router or a probe calls shows in the log",
    )

    def __post_init__(self) -> None:
        """Combinations no single flag can check (the CLI reports these as usage errors)."""
        if self.enable_reasoning and self.reasoning_parser is None:
            raise ValueError("--enable-reasoning needs --reasoning-parser (qwen3 or deepseek_r1)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both the key and the certificate")
        images_per_prompt(self.limit_mm_per_prompt)  # a bad modality or count: a usage error now
        for flag, value in (("--media-fetch-timeout", self.media_fetch_timeout),
                            ("--max-image-bytes", self.max_image_bytes), ("--max-image-pixels", self.max_image_pixels)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
