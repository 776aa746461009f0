"""Stage the GPU proof (issue 37) on the CPU machine, before any device time
is spent: the wheel bundle (`.whl/`), the model folders (`.gpu_models/`),
FlashInfer's kernels from an earlier session if any (`.gpu_jit/`), a size
check of everything a device `run` takes along, and the exact `run`
arguments to paste.

    python tools/gpu/stage.py              # build what is missing, check the size, print the calls
    python tools/gpu/stage.py --dry-run    # ... and walk gpu_check.sh's phases here (no CUDA needed)
    python tools/gpu/stage.py --rebuild    # rebuild the bundle even if .whl/ holds one
    python tools/gpu/stage.py --kernels /work/.device/N/flashinfer-kernels.tar.gz
                                           # keep a call's harvested kernels for the next calls

The kernels: a proof call compiles FlashInfer's modules (~4 minutes of nvcc
on 16 cores, most of a fresh machine's budget) and brings them back as
flashinfer-kernels.tar.gz; carried in `.gpu_jit/`, the next call installs
them as prebuilt modules and its JIT step finds them built. `--kernels`
also keeps a copy in ~/.cache/aioserve/gpu-kernels/, which staging restores
into a checkout without `.gpu_jit/` (a new session's clone).

The first call (`proof`) fits a fresh machine in ~8 minutes: install, the
FlashInfer JIT the tests need, every gpu-marked test isolated, then the
Qwen3-0.6B figures if time is left. The second (`figures`) goes on the
still-warm machine (it stays warm only ~30 s: paste it at once) or a fresh
one if the lease has the minutes. The third (`larger`) only where ~4
minutes are left after both: the Llama-3-8B shape's batch-1 step and
speculative figure, then FP8 and MoE at that size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = (".whl", ".gpu_models", ".gpu_jit")  # all git-ignored; .gpu_jit/ may be absent
KERNELS = Path(".gpu_jit") / "flashinfer-kernels.tar.gz"  # what gpu_check.sh's install_kernels reads
DEVICE_LIMIT_MIB = 64  # the device tool's cap on the working tree plus carried paths
HEADROOM_MIB = 8  # what staging keeps free under that cap
DRY_PHASES = ("proof", "figures", "larger", "tests-families", "bench-families")


@dataclass(frozen=True)
class RunCall:
    """One device `run` call's arguments."""

    command: str
    carry: list[str]
    timeout_s: int


def run_calls() -> dict[str, RunCall]:
    """The proof on a fresh machine, then the figures on the warm one. The
    script's budget ends its steps ~40 s before the call's timeout, so what
    it wrote under $OUT comes back even when a step runs long."""
    return {
        "proof": RunCall("GPU_CHECK_BUDGET=500 bash benchmarks/gpu_check.sh proof", list(CARRY), 540),
        "figures": RunCall("GPU_CHECK_BUDGET=260 bash benchmarks/gpu_check.sh figures", list(CARRY), 300),
        # Only where the lease still has this long after the two above (their
        # kernels carried): the Llama-3-8B shape, its speculative figure, FP8 and MoE.
        "larger": RunCall("GPU_CHECK_BUDGET=200 bash benchmarks/gpu_check.sh larger", list(CARRY), 240),
    }


def travelling_files(repo: Path) -> list[Path]:
    """What a call sends: tracked and untracked-not-ignored files, and the carried folders."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    files = [repo / name for name in listed if name]
    for carried in CARRY:
        files += [path for path in (repo / carried).rglob("*") if path.is_file()]
    return files


def travelling_mib(repo: Path) -> float:
    return sum(path.stat().st_size for path in travelling_files(repo) if path.exists()) / 2**20


def size_problem(mib: float, limit_mib: float = DEVICE_LIMIT_MIB, headroom_mib: float = HEADROOM_MIB) -> str | None:
    """Why `mib` would not travel safely; None when it fits with headroom."""
    if mib > limit_mib - headroom_mib:
        return (f"a call would take {mib:.1f} MiB along; the device tool takes {limit_mib} MiB "
                f"and staging keeps {headroom_mib} MiB free (dropping {KERNELS} costs only JIT time)")
    return None


def keep_kernels(harvested: Path, repo: Path = REPO, cache: Path | None = None) -> Path:
    """A call's flashinfer-kernels.tar.gz, kept where the next calls carry it
    from, and in the user's cache for the next session's checkout (`.gpu_jit/`
    is git-ignored: a new clone has none, and the proof then spends ~200 s of
    its lease compiling)."""
    with tarfile.open(harvested) as tar:
        names = tar.getnames()
    if "KERNELS_OF" not in names:
        raise ValueError(f"{harvested} is no harvest of gpu_check.sh (it names no KERNELS_OF)")
    kept = repo / KERNELS
    for place in (kept, cache or kernels_cache()):
        place.parent.mkdir(parents=True, exist_ok=True)
        if place.resolve() != harvested.resolve():
            shutil.copyfile(harvested, place)
    return kept


def kernels_cache() -> Path:
    """Where kept kernels outlive a checkout: ~/.cache/aioserve/gpu-kernels/ (or $XDG_CACHE_HOME's)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "aioserve" / "gpu-kernels" / KERNELS.name


def restore_kernels(repo: Path = REPO, cache: Path | None = None) -> Path | None:
    """The cached kernels copied into a checkout that has none; None when
    it has its own or the cache is empty."""
    cached, kept = cache or kernels_cache(), repo / KERNELS
    if kept.exists() or not cached.exists():
        return None
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, kept)
    return kept


def build(rebuild: bool) -> None:
    """The bundle (when missing or asked for) and the model folders (always: seconds)."""
    if rebuild or not any((REPO / ".whl").glob("flashinfer_python-*.whl")):
        subprocess.run([sys.executable, str(REPO / "tools/gpu/make_bundle.py")], cwd=REPO, check=True)
    subprocess.run([sys.executable, str(REPO / "tools/gpu/prepare_models.py")], cwd=REPO, check=True)


def dry_run(phase: str, python: str = sys.executable) -> tuple[int, str]:
    """gpu_check.sh's `phase` with nothing run: (exit code, its steps.txt)."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OUT": out, "GPU_CHECK_DRY_RUN": "1", "PYTHON": python}
        done = subprocess.run(["bash", "benchmarks/gpu_check.sh", phase], cwd=REPO, env=env, capture_output=True)
        steps = Path(out, "steps.txt")
        return done.returncode, steps.read_text() if steps.exists() else done.stderr.decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="rebuild .whl/ even if it holds a bundle")
    parser.add_argument("--dry-run", action="store_true", help="walk gpu_check.sh's phases here, running nothing")
    parser.add_argument("--no-build", action="store_true", help="only check and print (what is there already)")
    parser.add_argument("--kernels", type=Path, help="a call's flashinfer-kernels.tar.gz, to carry from now on")
    args = parser.parse_args()
    start = time.monotonic()
    if args.kernels:
        print(f"kernels kept in {keep_kernels(args.kernels)} and {kernels_cache()}")
    elif (restored := restore_kernels()) is not None:
        print(f"kernels of an earlier session restored from {kernels_cache()} into {restored}")
    if not args.no_build:
        build(args.rebuild)
    mib = travelling_mib(REPO)
    problem = size_problem(mib)
    print(f"a call takes {mib:.1f} MiB along (cap {DEVICE_LIMIT_MIB} MiB)")
    if problem:
        print(f"NOT STAGED: {problem}", file=sys.stderr)
        return 1
    if args.dry_run:
        for phase in DRY_PHASES:
            code, steps = dry_run(phase)
            print(f"-- dry run of {phase}: {'wired' if code == 0 else 'NOT WIRED'}\n{steps}")
            if code:
                return 1
    print(f"staged in {time.monotonic() - start:.0f} s; the device calls, in order:")
    for name, call in run_calls().items():
        print(f"{name}: {json.dumps(asdict(call))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
