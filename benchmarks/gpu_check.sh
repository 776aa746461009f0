#!/usr/bin/env bash
# The one script a GPU session runs (issue 11): wheels, models, FlashInfer's
# JIT, the GPU tests, and the benchmarks, every figure into $OUT.
#
# Usage, on the GPU machine, from the repository root:
#     bash benchmarks/gpu_check.sh PHASE        # PHASE: setup | tests | bench | bench-8b | all
# Before the session, on the CPU machine:
#     python tools/gpu/prepare_models.py    # -> .gpu_models/ (4 MiB)
#     python tools/gpu/make_bundle.py       # -> .whl/ (27 MiB: trimmed FlashInfer + server wheels)
# Both are git-ignored: each device `run` names them in carry: [".whl", ".gpu_models"].
# Then one `run` call per phase, in order (each <= 10 min wall; the machine
# stays warm ~30 s between calls and keeps /tmp, so the wheels and the JIT
# cache survive; a phase run on a fresh machine redoes the install first):
#     run: bash benchmarks/gpu_check.sh setup      (install, versions, JIT warm-up: minutes of nvcc)
#     run: bash benchmarks/gpu_check.sh tests      (the GPU tests, then CUDA runs of CPU-side tests, through
#                                                  tools/gpu/isolated_tests.py: no test can hide another;
#                                                  a test cut by its timeout while nvcc compiles: run it again,
#                                                  the JIT cache in /tmp is warm by then)
#     run: bash benchmarks/gpu_check.sh bench      (Qwen3-0.6B dummy: offline x3, roofline with/without graphs)
#     run: bash benchmarks/gpu_check.sh bench-8b   (Llama-3-8B-shaped dummy: offline x3, roofline)
#     run: bash benchmarks/gpu_check.sh tests-families   (issue 30's GPU tests: fused MoE, FP8 GEMMs, FP8 KV
#                                                  cache; then test_moe.py and test_gemma3.py on CUDA)
#     run: bash benchmarks/gpu_check.sh bench-families  (issue 30: Qwen3-MoE tiny and 8B-shaped, with and
#                                                  without FlashInfer's fused MoE; FP8 128x128-block Qwen3-0.6B
#                                                  and Llama-3-8B against their bf16 runs of `bench`/`bench-8b`)
# `all` runs setup, tests, bench and bench-8b in order and skips what no longer fits the call's budget.
#
# What comes back (at most 8 files, as the device tool allows):
#     $OUT/steps.txt            one line per step: phase, step, status, seconds
#     $OUT/<phase>.log          the phase's whole console (setup.log, tests.log, bench.log)
#     $OUT/tests/gpu-summary.txt, cuda-summary.txt   one line per test: outcome, seconds, node id
#     $OUT/tests/gpu-reruns.log  the console of each failure rerun alone with CUDA_LAUNCH_BLOCKING=1,
#                               and each cut test's stack dump and server log tails
#     $OUT/flashinfer-kernels.tar.gz  every FlashInfer module built (proof, figures): copy it to
#                               .gpu_jit/ (tools/gpu/stage.py --kernels FILE) and the next call skips that JIT
#     (tests-families: gpu-families-summary.txt, gpu-families-reruns.log, cuda-families-summary.txt)
#     $OUT/bench/results.json   every benchmark JSON of this machine so far, by run name
#     $OUT/bench/summary.md     the tables for the issue's closing note
# Environment: GPU_CHECK_BUDGET (seconds for the whole call, default 560),
# PYTHON (default /opt/torch/.venv/bin/python3), GPU_CHECK_DRY_RUN=1 (run
# nothing: check that each step's function, script or program exists, record
# it as "dry" or "UNWIRED", exit 1 if any is unwired; tools/gpu/stage.py
# --dry-run and CI use it). Steps never abort the phase: each is timed out
# on its own, recorded, and the next one runs.

set -u -o pipefail

PHASE="${1:-all}"
PY="${PYTHON:-/opt/torch/.venv/bin/python3}"
OUT="${OUT:-$PWD/gpu_out}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"   # survives between calls on a warm machine
SITE="${GPU_CHECK_SITE:-/tmp/site}"        # the carried wheels, installed
RESULTS="$WORK/results"            # benchmark JSONs, gathered into $OUT/bench at the end
START=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET:-560}"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE:$PWD"
export AIOSERVE_NATIVE=0           # CPU kernels: nothing here runs on the CPU path; skips a C++ build
# FlashInfer's JIT: Hopper only (H100/H200 are sm_90a), 16 cores, cache in /tmp.
export FLASHINFER_CUDA_ARCH_LIST="9.0a" TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 FLASHINFER_NVCC_THREADS=1
export FLASHINFER_WORKSPACE_BASE="$WORK"   # -> $WORK/.cache/flashinfer
if [ -z "${CUDA_HOME:-}" ]; then
    NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    CUDA_HOME="$(dirname "$(dirname "$NVCC")")"
    export CUDA_HOME
fi
export PATH="$CUDA_HOME/bin:$PATH"
export PY WORK SITE RESULTS OUT

mkdir -p "$OUT" "$WORK" "$RESULTS"

QWEN=.gpu_models/qwen3
LLAMA8B=.gpu_models/llama3-8b-instruct
OFFLINE_ARGS=(--load-format dummy --dtype bfloat16 --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --seed 0)
ROOF_ARGS=(--load-format dummy --dtype bfloat16 --batch 1 16 64 256 --context 512 --repeats 20)

# -- steps ------------------------------------------------------------------------------

left() { echo $((BUDGET - ($(date +%s) - START))); }

DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
# wired COMMAND...: does what the step would run exist? (a dry run's check)
wired() {
    while [ "${1:-}" = env ] || [[ "${1:-}" == *=* ]]; do shift; done   # env VAR=value ... COMMAND
    case "${1:-}" in
        bash) [ "${2:-}" = -c ] && declare -F "${3%% *}" >/dev/null ;;
        "$PY") [ -f "${2:-}" ] ;;
        *) command -v "${1:-}" >/dev/null ;;
    esac
}

# step NAME LIMIT_S COMMAND...: run with a timeout clipped to the call's budget;
# record "phase step status seconds"; never fail the phase.
step() {
    local name="$1" limit="$2"
    shift 2
    local remaining status rc t0 seconds
    remaining=$(left)
    if [ "$DRY_RUN" = 1 ]; then
        seconds=0
        if wired "$@"; then status=dry; else status=UNWIRED; fi
        echo "== step $name (dry run): $*"
    elif [ "$remaining" -lt 30 ]; then
        status="SKIP(no time)"; seconds=0
    else
        [ "$limit" -gt $((remaining - 15)) ] && limit=$((remaining - 15))
        echo "== step $name (limit ${limit}s): $*"
        t0=$(date +%s)
        timeout -k 10 "$limit" "$@"
        rc=$?
        seconds=$(($(date +%s) - t0))
        case $rc in
            0) status=ok ;;
            124 | 137) status="TIMEOUT(${limit}s)" ;;
            *) status="FAIL(rc=$rc)" ;;
        esac
    fi
    echo "== step $name: $status in ${seconds}s"
    printf '%-9s %-28s %-16s %5ss\n' "$PHASE_NAME" "$name" "$status" "$seconds" >>"$OUT/steps.txt"
    return 0
}

install_wheels() {
    # Skipped when $SITE already holds this exact bundle (a warm machine).
    local stamp
    stamp=$(stat -c '%n %s %Y' .whl/*.whl 2>/dev/null | md5sum | cut -d' ' -f1)
    if [ -f "$SITE/.bundle-stamp" ] && [ "$(cat "$SITE/.bundle-stamp")" = "$stamp" ]; then
        echo "wheels already installed in $SITE"
        return 0
    fi
    ls .whl/*.whl >/dev/null || { echo "no wheels in .whl/"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl &&
        echo "$stamp" >"$SITE/.bundle-stamp" && ls -d "$SITE"/*.dist-info
}

# FlashInfer's kernels compiled by an earlier call (a session's JIT cache,
# brought back by harvest_kernels and carried in .gpu_jit/): unpacked where
# FlashInfer looks for prebuilt modules (flashinfer/data/aot/<name>/<name>.so,
# loaded with no build step), so the jit step finds them built. Only for the
# same FlashInfer version and arch: a module's name does not encode either.
# Exported: the steps run these functions in a child `bash -c`, which sees only exports.
export KERNELS_TAR=.gpu_jit/flashinfer-kernels.tar.gz
install_kernels() {
    [ -f "$KERNELS_TAR" ] || { echo "no $KERNELS_TAR: every kernel is compiled here"; return 0; }
    local aot want have
    aot=$("$PY" -c 'import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)') || return 1
    want=$("$PY" -c 'import flashinfer; print(flashinfer.__version__)')-sm90a
    have=$(tar -xzOf "$KERNELS_TAR" KERNELS_OF 2>/dev/null)
    if [ "$have" != "$want" ]; then
        echo "$KERNELS_TAR holds kernels of $have, not $want: not used"
        return 0
    fi
    mkdir -p "$aot" && tar -xzf "$KERNELS_TAR" -C "$aot" --exclude KERNELS_OF &&
        echo "$(ls "$aot" | wc -l) prebuilt FlashInfer modules ($have) in $aot"
}

# Every FlashInfer module this machine has built or been given, for the
# next session's carry: $OUT/flashinfer-kernels.tar.gz (shared objects only).
harvest_kernels() {
    local stage version aot so
    version=$("$PY" -c 'import flashinfer; print(flashinfer.__version__)') || return 1
    aot=$("$PY" -c 'import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)') || return 1
    stage=$(mktemp -d)
    for so in "$aot"/*/*.so "$WORK/.cache/flashinfer/$version/90a/cached_ops"/*/*.so; do
        [ -f "$so" ] || continue
        mkdir -p "$stage/$(basename "$(dirname "$so")")"
        cp "$so" "$stage/$(basename "$(dirname "$so")")/"
    done
    echo "$version-sm90a" >"$stage/KERNELS_OF"
    tar -czf "$OUT/flashinfer-kernels.tar.gz" -C "$stage" $(ls "$stage") && rm -rf "$stage" &&
        echo "harvested $(tar -tzf "$OUT/flashinfer-kernels.tar.gz" | grep -c '\.so$') modules," \
            "$(du -h "$OUT/flashinfer-kernels.tar.gz" | cut -f1)"
}

unpack_models() {
    local gz from
    for gz in .gpu_models/*/tokenizer.json.gz; do
        [ -f "${gz%.gz}" ] || gunzip -k "$gz" || return 1
    done
    # a variant's tokenizer is its base's (tools/gpu/prepare_models.py)
    for from in .gpu_models/*/tokenizer.json.from; do
        [ -f "$from" ] || continue
        cp ".gpu_models/$(cat "$from")/tokenizer.json" "$(dirname "$from")/tokenizer.json" || return 1
    done
    du -sh .gpu_models/*
}

versions() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nvcc --version | tail -2
    "$PY" - <<'EOF'
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE",
      "| capability", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else "-")
for name in ("flashinfer-python", "triton", "transformers", "tokenizers", "starlette", "hypercorn", "pydantic",
             "xgrammar", "openai", "httpx", "uvloop", "apache-tvm-ffi", "nvidia-cudnn-frontend"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
try:
    import flashinfer
    print("flashinfer imports:", flashinfer.__version__, flashinfer.__file__)
except Exception as error:  # the reason `auto` would fall back to torch_native
    print("flashinfer does NOT import:", repr(error))
EOF
}

# Compile FlashInfer's kernels for a model by serving a few steps with it
# (prefill, then decode replays at batch 1, 3 and 13), so that compile time
# shows here and not inside a test or a benchmark.
warm_jit() {
    "$PY" - "$@" <<'EOF'
import logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
from aioserve import LLM, SamplingParams
model, *extra = sys.argv[1:]
options = {"attention_backend": "flashinfer", "dtype": "bfloat16"}
for word in extra:  # dummy | kv=DTYPE | pages=N (several warm-ups share the GPU: a fixed pool each)
    if word == "dummy":
        options["load_format"] = "dummy"
    elif word.startswith("kv="):
        options["kv_cache_dtype"] = word[3:]
    elif word.startswith("pages="):
        options["num_pages"] = int(word[6:])
start = time.perf_counter()
llm = LLM(model, **options)
runner = llm.engine.graph_runner
print(f"{model}: engine (load, JIT of what capture needs, graphs {runner.batch_sizes if runner else None}) "
      f"in {time.perf_counter() - start:.1f}s; backend {llm.engine.attention_backend_name}")
for n in (1, 3, 13):
    start = time.perf_counter()
    llm.generate([[100 + i, 101, 102, 103, 104] for i in range(n)], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    print(f"{model}: generate x{n} in {time.perf_counter() - start:.1f}s")
llm.close()
EOF
}

# The FlashInfer modules the GPU tests need, compiled at once: one warm-up
# process per (head_dim, KV dtype) the tests use, side by side (FlashInfer
# locks each module's build, so shared ones compile once).
warm_parallel() {
    local pids=() names=(hd128 hd64 hd64-fp8kv) i rc=0
    warm_jit "$QWEN" dummy pages=2048 >"$WORK/warm-hd128.log" 2>&1 &
    pids+=($!)
    warm_jit .gpu_models/qwen3-hd64 dummy pages=2048 >"$WORK/warm-hd64.log" 2>&1 &
    pids+=($!)
    warm_jit .gpu_models/qwen3-hd64 dummy pages=2048 kv=fp8_e4m3 >"$WORK/warm-hd64-fp8kv.log" 2>&1 &
    pids+=($!)
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { rc=1; echo "warm-up ${names[$i]} FAILED"; }
        echo "---- warm-up ${names[$i]}:"; tail -25 "$WORK/warm-${names[$i]}.log"
    done
    return $rc
}

export -f install_wheels install_kernels harvest_kernels unpack_models versions warm_jit warm_parallel
export QWEN

# Cheap when already done: every phase may land on a fresh machine.
ensure_ready() {
    [ "$DRY_RUN" != 1 ] && [ -f "$SITE/.bundle-stamp" ] && ls .gpu_models/*/tokenizer.json >/dev/null 2>&1 &&
        return 0
    step install 240 bash -c install_wheels
    step kernels 60 bash -c install_kernels
    step models 60 bash -c unpack_models
}

# -- phases -----------------------------------------------------------------------------

phase_setup() {
    step install 240 bash -c install_wheels
    step models 60 bash -c unpack_models
    step versions 60 bash -c versions
    step jit-qwen3 420 bash -c "warm_jit $QWEN dummy"
    step jit-stories 240 bash -c "warm_jit aioserve/demo_model"
    du -sh "$WORK/.cache/flashinfer" 2>/dev/null
}

phase_tests() {
    ensure_ready
    mkdir -p "$OUT/tests"
    # The GPU tests, file by file with -x: a failure ends its process (a CUDA
    # fault is sticky and would fail every later test), is rerun alone with
    # CUDA_LAUNCH_BLOCKING=1 so its log names the faulting kernel, and the
    # file goes on in a fresh process. One line per test in summary.txt.
    step pytest-gpu 420 "$PY" tools/gpu/isolated_tests.py --out "$WORK/gpu-tests" --timeout 240 \
        --budget 400 -m gpu tests/test_gpu.py tests/test_gpu_fast_path.py
    cp "$WORK/gpu-tests/summary.txt" "$OUT/tests/gpu-summary.txt" 2>/dev/null
    # The logs of failures only (what comes back is capped at 8 files).
    cat "$WORK"/gpu-tests/rerun-*.log "$WORK"/gpu-tests/timeout-*.log > "$OUT/tests/gpu-reruns.log" 2>/dev/null
    # CPU-side suites that run on CUDA when it is there (device auto): the
    # default backend on CUDA (FlashInfer) against transformers in fp32, the
    # batch-invariance and plan-seam checks, the sampler.
    step pytest-cuda 300 "$PY" tools/gpu/isolated_tests.py --out "$WORK/cuda-tests" --timeout 240 \
        --budget 280 tests/test_greedy_matches_hf.py tests/test_batching_invariance.py \
        tests/test_plan_seam.py tests/test_sampler.py
    cp "$WORK/cuda-tests/summary.txt" "$OUT/tests/cuda-summary.txt" 2>/dev/null
}

# Named tests again (GPU_RETEST="tests/a.py::t tests/b.py"), each isolated, as the
# proof runs them: a fix made on CPU after a proof call, checked with what is left of a lease.
phase_retest() {
    ensure_ready
    mkdir -p "$OUT/tests"
    # shellcheck disable=SC2086  # the variable is a list of test ids
    step pytest-retest "$(left)" "$PY" tools/gpu/isolated_tests.py --out "$WORK/retest" --timeout 240 \
        --budget "$(($(left) - 30))" ${GPU_RETEST:?GPU_RETEST names the tests}  # under the step's own limit (left - 15)
    cp "$WORK/retest/summary.txt" "$OUT/tests/retest-summary.txt" 2>/dev/null
    cat "$WORK"/retest/rerun-*.log "$WORK"/retest/timeout-*.log > "$OUT/tests/retest-reruns.log" 2>/dev/null
}

# Issue 37's one call on a fresh machine: install, the JIT the tests need,
# then every gpu-marked test, each isolated, failures rerun alone with
# CUDA_LAUNCH_BLOCKING=1; the Qwen3-0.6B figures only if time is left.
# What has not passed on a GPU yet goes first: on 2026-11-28 (H200) the files
# from test_gate_up_silu.py to test_speculative_eagle3.py passed, the Gemma 3
# image test alone took 90 s, and the budget ran out in test_gpu_fast_path.py;
# the FP8, MoE, pooling and LoRA files have never run on a GPU. The image test goes last.
GPU_TEST_FILES=(tests/test_gpu_fast_path.py tests/test_fp8_kv_cache.py tests/test_fp8_block_gemm.py
    tests/test_fp8_checkpoints.py tests/test_compressed_tensors.py tests/test_flashinfer_moe.py
    tests/test_gpu_pooling.py tests/test_gpu_lora.py
    tests/test_gate_up_silu.py tests/test_qk_rope_store.py tests/test_gpu.py tests/test_speculative.py
    tests/test_speculative_draft.py tests/test_speculative_eagle3.py tests/test_gpu_vision.py)
phase_proof() {
    step install 240 bash -c install_wheels
    step kernels 60 bash -c install_kernels
    step models 60 bash -c unpack_models
    step versions 60 bash -c versions
    step jit 240 bash -c warm_parallel
    du -sh "$WORK/.cache/flashinfer" 2>/dev/null
    mkdir -p "$OUT/tests"
    step pytest-gpu $(($(left) - 50)) "$PY" tools/gpu/isolated_tests.py --out "$WORK/gpu-tests" --timeout 300 \
        --budget $(($(left) - 70)) -m gpu "${GPU_TEST_FILES[@]}"
    cp "$WORK/gpu-tests/summary.txt" "$OUT/tests/gpu-summary.txt" 2>/dev/null
    cat "$WORK"/gpu-tests/rerun-*.log "$WORK"/gpu-tests/timeout-*.log >"$OUT/tests/gpu-reruns.log" 2>/dev/null
    step harvest 60 bash -c harvest_kernels   # before the figures: the next session's JIT is these kernels
    [ "$(left)" -gt 150 ] && offline qwen3-graphs-overlap "$QWEN"
    [ "$(left)" -gt 90 ] && roofline qwen3-graphs "$QWEN"
    [ "$(left)" -gt 120 ] && speculative qwen3 "$QWEN"   # with the kernels carried, the JIT leaves room for it
    return 0
}

# The speculative figure alone (what is left of a lease after the proof and figures).
phase_speculative() {
    ensure_ready
    speculative qwen3 "$QWEN"
    return 0
}

# The second call on the still-warm machine: figures first, then the
# CPU-side suites on CUDA.
phase_figures() {
    ensure_ready
    offline qwen3-graphs-overlap "$QWEN"
    roofline qwen3-graphs "$QWEN"
    AIOSERVE_QK_ROPE_STORE=0 roofline qwen3-graphs-separate-qk "$QWEN"   # the fused q/k kernel's gain
    AIOSERVE_GATE_UP_SILU=0 roofline qwen3-graphs-separate-mlp "$QWEN"   # the fused gate|up + SiLU kernel's
    step serving-qwen3 240 bash -c serving_run
    speculative qwen3 "$QWEN"
    mkdir -p "$OUT/tests"
    step pytest-cuda $(($(left) - 20)) "$PY" tools/gpu/isolated_tests.py --out "$WORK/cuda-tests" --timeout 200 \
        --budget $(($(left) - 40)) tests/test_greedy_matches_hf.py tests/test_batching_invariance.py \
        tests/test_plan_seam.py tests/test_sampler.py
    cp "$WORK/cuda-tests/summary.txt" "$OUT/tests/cuda-summary.txt" 2>/dev/null
    step harvest 60 bash -c harvest_kernels
    return 0
}

# The third call, where the lease has minutes left after proof and figures
# (a start, ~4 minutes of proof with the kernels carried, ~3 of figures): the
# Llama-3-8B shape at batch 1 (issue 37's 8B-shaped figure), speculative
# decoding on it (issue 40's), then the 8B-shaped MoE and FP8 step, most
# wanted first; what the budget does not reach is skipped.
phase_larger() {
    ensure_ready
    roofline llama8b-graphs "$LLAMA8B"
    # One round, and of the drafts only the target as its own (issue 40's 8B figure):
    # 80 s did not hold all six 8B engines (2026-11-28).
    speculative llama8b "$LLAMA8B" --repeats 1 --draft-models target
    roofline llama8b-fp8 .gpu_models/llama3-8b-fp8
    offline moe-8b .gpu_models/qwen3-moe-8b
    [ "$(left)" -gt 40 ] && step harvest 40 bash -c harvest_kernels   # the 8B shapes' prefill modules too
    return 0
}

offline() {  # offline NAME MODEL [extra options]
    local name="$1" model="$2"
    shift 2
    step "offline-$name" 300 "$PY" benchmarks/offline.py --model "$model" "${OFFLINE_ARGS[@]}" "$@" \
        --json "$RESULTS/offline-$name.json"
}

roofline() {  # roofline NAME MODEL [extra options]
    local name="$1" model="$2"
    shift 2
    step "roofline-$name" 240 "$PY" benchmarks/roofline.py --model "$model" "${ROOF_ARGS[@]}" "$@" \
        --json "$RESULTS/roofline-$name.json"
}

# Speculative decoding at batch 1 (issue 40): plain (with and without
# overlap), ngram, the oracle's ceiling and floor, the target as its own
# draft, a 1-layer random draft and a random EAGLE-3 head.
speculative() {  # speculative NAME MODEL [options; default: --repeats 2 --draft-models]
    local name="$1" model="$2"
    shift 2
    [ $# -eq 0 ] && set -- --repeats 2 --draft-models
    step "speculative-$name" 150 "$PY" benchmarks/speculative.py --model "$model" --load-format dummy \
        --dtype bfloat16 --concurrency 1 --tokens 128 "$@" --cuda-graph-max-bs 8 --num-pages 512 \
        --json "$RESULTS/speculative-$name.json"
}

# What users see: the server over HTTP (Qwen3-0.6B-shaped dummy, defaults:
# FlashInfer, graphs, overlap), streamed completions at concurrency 1, 16, 64.
serving_run() {
    local port=8123 log="$WORK/serve.log" pid c
    "$PY" -m aioserve serve --model "$QWEN" --load-format dummy --dtype bfloat16 --port $port >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || { tail -20 "$log"; return 1; }
        sleep 1
    done
    for c in 1 16 64; do
        "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$port" -n $((c * 4)) --max-concurrency $c \
            --input-len 256 --output-len 256 --prompts-as-ids --no-progress --label "qwen3-c$c" \
            --json "$RESULTS/serving-qwen3-c$c.json" || break
    done
    kill -INT $pid; wait $pid
}
export -f serving_run

phase_bench() {
    ensure_ready
    step serving-qwen3 300 bash -c serving_run
    offline qwen3-graphs-overlap "$QWEN"
    roofline qwen3-graphs "$QWEN"
    offline qwen3-no-graphs "$QWEN" --disable-cuda-graph
    offline qwen3-no-overlap "$QWEN" --disable-overlap
    roofline qwen3-no-graphs "$QWEN" --disable-cuda-graph
    # FlashInfer's fused RMSNorm/RoPE/SiLU against the torch forms (issue 11: used "where they beat torch").
    step roofline-qwen3-torch-elementwise 240 env AIOSERVE_FLASHINFER_ELEMENTWISE=0 "$PY" benchmarks/roofline.py \
        --model "$QWEN" "${ROOF_ARGS[@]}" --disable-cuda-graph --json "$RESULTS/roofline-qwen3-torch-elementwise.json"
}

phase_tests_families() {
    ensure_ready
    mkdir -p "$OUT/tests"
    step pytest-gpu-families 300 "$PY" tools/gpu/isolated_tests.py --out "$WORK/gpu-families" --timeout 240 \
        --budget 280 -m gpu tests/test_flashinfer_moe.py tests/test_fp8_block_gemm.py tests/test_fp8_checkpoints.py \
        tests/test_compressed_tensors.py \
        tests/test_fp8_kv_cache.py
    cp "$WORK/gpu-families/summary.txt" "$OUT/tests/gpu-families-summary.txt" 2>/dev/null
    cat "$WORK"/gpu-families/rerun-*.log > "$OUT/tests/gpu-families-reruns.log" 2>/dev/null
    step pytest-cuda-families 240 "$PY" tools/gpu/isolated_tests.py --out "$WORK/cuda-families" --timeout 200 \
        --budget 220 tests/test_moe.py tests/test_gemma3.py
    cp "$WORK/cuda-families/summary.txt" "$OUT/tests/cuda-families-summary.txt" 2>/dev/null
}

# Issue 30's families. FlashInfer's fused MoE builds only from a full
# flashinfer-python (the bundle's trimmed wheel lacks its sources): without it
# the `moe-*` runs are torch's grouped matmul and the `-torch-moe` runs equal them.
phase_bench_families() {
    ensure_ready
    offline moe-tiny .gpu_models/qwen3-moe-tiny
    step offline-moe-tiny-torch-moe 300 env AIOSERVE_FLASHINFER_MOE=0 "$PY" benchmarks/offline.py \
        --model .gpu_models/qwen3-moe-tiny "${OFFLINE_ARGS[@]}" --json "$RESULTS/offline-moe-tiny-torch-moe.json"
    offline moe-8b .gpu_models/qwen3-moe-8b
    offline qwen3-fp8 .gpu_models/qwen3-fp8
    offline llama8b-fp8 .gpu_models/llama3-8b-fp8
    roofline llama8b-fp8 .gpu_models/llama3-8b-fp8
    # Images (issue 43): the Qwen2.5-VL-3B shape's encoder rate and time to first token, fresh and cached.
    step vision-qwen2.5-vl-3b 240 bash -c vision_run
}

vision_run() {
    "$PY" benchmarks/vision.py --shape qwen2.5-vl-3b --dtype bfloat16 >"$RESULTS/vision-qwen2.5-vl-3b.md"
}
export -f vision_run

phase_bench_8b() {
    ensure_ready
    offline llama8b-graphs-overlap "$LLAMA8B"
    roofline llama8b-graphs "$LLAMA8B"
    offline llama8b-no-graphs "$LLAMA8B" --disable-cuda-graph
    offline llama8b-no-overlap "$LLAMA8B" --disable-overlap
}

# Every result this machine has produced (this call's and earlier calls') into
# one JSON and one Markdown table.
summarize() {
    mkdir -p "$OUT/bench"
    "$PY" - "$RESULTS" "$OUT/bench" <<'EOF'
import json, sys
from pathlib import Path
results, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
(out / "results.json").write_text(json.dumps(runs, indent=2))
lines = ["## Offline: 256 requests, input and output uniform in 100-1024 (dummy weights, bf16)", "",
         "| run | device | attention | graph sizes | overlap | output tok/s | total tok/s | elapsed s | steps | graph replays | preemptions |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for name, r in runs.items():
    if name.startswith("offline-"):
        lines.append(f"| {name[8:]} | {r.get('device')} | {r.get('attention_backend')} | {r.get('cuda_graph_batch_sizes')} "
                     f"| {r.get('overlap')} | {r['output_tokens_per_s']} | {r['total_tokens_per_s']} | {r['elapsed_s']} "
                     f"| {r['steps']} | {r.get('graph_replays')} | {r['preemptions']} |")
lines += ["", "## Decode step against the roofline (context 512)", "",
          "| run | batch | bound ms | step ms | host launch ms | gpu ms | host < gpu | bound/step | tok/s | bound tok/s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
for name, rows in runs.items():
    if name.startswith("roofline-"):
        for r in rows:
            host, gpu = r.get("host_launch_ms"), r.get("gpu_ms")
            below = "" if host is None or gpu is None else str(host < gpu).lower()
            fmt = lambda v: "" if v is None else f"{v:.2f}"
            lines.append(f"| {name[9:]} | {r['batch']} | {r['bound_ms']:.2f} | {r['measured_ms']:.2f} | {fmt(host)} "
                         f"| {fmt(gpu)} | {below} | {r['of_bound']:.2f} | {r['batch'] / r['measured_ms'] * 1e3:.0f} "
                         f"| {r['batch'] / r['bound_ms'] * 1e3:.0f} |")
lines += ["", "## Speculative decoding at batch 1 (greedy, 128 tokens; agree: share equal to plain before a difference)", "",
          "| run | method | tok/s | vs plain | acceptance length | agree | overlapped |", "|---|---|---|---|---|---|---|"]
for name, rows in runs.items():
    if name.startswith("speculative-"):
        for r in rows:
            overlapped = "" if r.get("overlapped") is None else f"{r['overlapped']:.2f}"
            lines.append(f"| {name[12:]} | {r['method']} | {r['tok_s']:.0f} | {r['vs_plain']:.2f}x | {r['acceptance']:.2f} "
                             f"| {r.get('agreement', 1.0):.2f} | {overlapped} |")
lines += ["", "## Serving over HTTP (streamed completions, 256 in / 256 out; benchmarks/serving.py's tables)", ""]
for name, r in runs.items():
    if name.startswith("serving-"):
        lines += ["```", r["table"], "```"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

# run_phase NAME LOGNAME FUNCTION: the phase's console into $OUT/LOGNAME.log.
run_phase() {
    local name="$1" log="$2" fn="$3" t0
    t0=$(date +%s)
    PHASE_NAME="$name"
    echo "#### phase $name ($(date -u +%FT%TZ), $(left)s of the call's budget left)" | tee -a "$OUT/$log.log"
    "$fn" 2>&1 | tee -a "$OUT/$log.log"
    echo "#### phase $name done in $(($(date +%s) - t0))s" | tee -a "$OUT/$log.log"
}

# Sourced with GPU_CHECK_SOURCE_ONLY=1 (tests/test_gpu_stage.py): the steps' functions, no phase.
if [ "${GPU_CHECK_SOURCE_ONLY:-0}" = 1 ]; then return 0 2>/dev/null || exit 0; fi

case "$PHASE" in
    setup) run_phase setup setup phase_setup ;;
    tests) run_phase tests tests phase_tests ;;
    retest) run_phase retest tests phase_retest ;;
    proof) run_phase proof proof phase_proof ;;
    figures) run_phase figures bench phase_figures ;;
    speculative) run_phase speculative bench phase_speculative ;;
    larger) run_phase larger bench phase_larger ;;
    bench) run_phase bench bench phase_bench ;;
    bench-8b) run_phase bench-8b bench phase_bench_8b ;;
    tests-families) run_phase tests-families tests phase_tests_families ;;
    bench-families) run_phase bench-families bench phase_bench_families ;;
    all)
        run_phase setup setup phase_setup
        run_phase tests tests phase_tests
        run_phase bench bench phase_bench
        run_phase bench-8b bench phase_bench_8b
        ;;
    *)
        echo "usage: $0 setup|tests|retest|proof|figures|larger|speculative|bench|bench-8b|tests-families|bench-families|all" >&2
        exit 2
        ;;
esac
case "$PHASE" in proof | figures | larger | speculative | bench | bench-8b | bench-families | all) summarize 2>&1 | tee -a "$OUT/bench.log" ;; esac
echo "#### steps of this call:"
cat "$OUT/steps.txt"
if [ "$DRY_RUN" = 1 ] && grep -q UNWIRED "$OUT/steps.txt"; then exit 1; fi
