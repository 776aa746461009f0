"""The GPU proof's staging (tools/gpu/stage.py) and gpu_check.sh's wiring,
on CPU: the size check, the calls it prints, and a dry run of every phase
a session pastes, which fails on a step whose function, script or program
does not exist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import stage  # noqa: E402  (tools/gpu is no package)


def test_size_check_keeps_headroom_under_the_device_cap() -> None:
    assert stage.size_problem(40.0) is None
    assert stage.size_problem(stage.DEVICE_LIMIT_MIB - stage.HEADROOM_MIB) is None
    problem = stage.size_problem(stage.DEVICE_LIMIT_MIB - stage.HEADROOM_MIB + 0.5)
    assert problem is not None and f"{stage.DEVICE_LIMIT_MIB} MiB" in problem


def test_the_tree_alone_leaves_room_for_the_bundle() -> None:
    """Tracked files take a few MiB; the bundle (~28) and models (~14) need the rest."""
    tracked = sum(p.stat().st_size for p in stage.travelling_files(REPO) if p.exists()
                  and not any(part in stage.CARRY for part in p.relative_to(REPO).parts)) / 2**20
    assert tracked < 16


def test_the_printed_calls_fit_the_device_tool() -> None:
    calls = stage.run_calls()
    assert list(calls) == ["proof", "figures", "larger"]
    for phase, call in calls.items():
        assert call.command.endswith(f"bash benchmarks/gpu_check.sh {phase}")
        budget = int(call.command.split("GPU_CHECK_BUDGET=")[1].split()[0])
        assert budget + 30 <= call.timeout_s <= 600  # the script ends before the call is cut
        assert len(call.command) <= 2000 and len(call.carry) <= 8
    assert calls["proof"].timeout_s <= 8 * 60 + 60  # a fresh machine's call: ~8 minutes
    for carried in stage.CARRY:  # carried, never committed
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{carried}/a.whl"], cwd=REPO)  # may not exist yet
        assert ignored.returncode == 0, f"{carried} is not git-ignored"


@pytest.mark.parametrize("phase", stage.DRY_PHASES)
def test_every_phase_is_wired(phase: str) -> None:
    code, steps = stage.dry_run(phase)
    assert code == 0, steps
    names = [line.split()[1] for line in steps.splitlines()]
    assert names and all(line.split()[2] == "dry" for line in steps.splitlines())
    if phase == "proof":  # correctness before figures
        assert names[:6] == ["install", "kernels", "models", "versions", "jit", "pytest-gpu"]
        assert names.index("pytest-gpu") < names.index("harvest") < names.index("offline-qwen3-graphs-overlap")


def test_the_retest_phase_runs_the_named_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """`retest` (a fix checked with what is left of a lease) needs GPU_RETEST
    and is wired like the proof's test step."""
    monkeypatch.setenv("GPU_RETEST", "tests/test_gpu_vision.py")
    code, steps = stage.dry_run("retest")
    assert code == 0, steps
    assert [line.split()[1] for line in steps.splitlines()] == ["install", "kernels", "models", "pytest-retest"]
    monkeypatch.delenv("GPU_RETEST")  # nothing named: no test step runs (the shell says why on stderr)
    code, steps = stage.dry_run("retest")
    assert "pytest-retest" not in steps and "models" in steps


def test_a_dry_run_fails_on_a_missing_script(tmp_path: Path) -> None:
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    broken = tmp_path / "gpu_check.sh"
    broken.write_text(script.replace("tools/gpu/isolated_tests.py", "tools/gpu/no_such_runner.py"))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(broken), "proof"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "pytest-gpu" in (tmp_path / "out" / "steps.txt").read_text().split("UNWIRED")[0].splitlines()[-1]


FAKE_FLASHINFER = {  # what install_kernels and harvest_kernels ask of FlashInfer
    "flashinfer/__init__.py": '__version__ = "0.7.2.post1+test"\n',
    "flashinfer/jit/__init__.py": "",
    "flashinfer/jit/env.py": "import pathlib\nFLASHINFER_AOT_DIR = pathlib.Path(__file__).parents[1] / 'data' / 'aot'\n",
}


def gpu_check_function(repo: Path, site: Path, work: Path, out: Path, call: str) -> subprocess.CompletedProcess:
    """One of gpu_check.sh's step functions, run in `repo` with a fake FlashInfer in `site`,
    in a child `bash -c` as its steps run them: it sees only what the script exports
    (an unexported variable once left every carried kernel unused on the GPU)."""
    env = {**os.environ, "GPU_CHECK_SOURCE_ONLY": "1", "GPU_CHECK_SITE": str(site), "GPU_CHECK_WORK": str(work),
           "OUT": str(out), "PYTHON": sys.executable}
    script = REPO / "benchmarks" / "gpu_check.sh"
    return subprocess.run(["bash", "-c", f"source {script} && bash -c {call}"], cwd=repo, env=env,
                          capture_output=True, text=True)


def test_kernels_built_by_one_call_are_prebuilt_in_the_next(tmp_path: Path) -> None:
    """harvest_kernels packs every module a call compiled (and any it was
    given); stage.py --kernels keeps the file in .gpu_jit/; install_kernels on
    the next machine puts each where FlashInfer loads a prebuilt module
    (data/aot/<name>/<name>.so) -- only for the FlashInfer version that built it."""
    site, work = tmp_path / "site", tmp_path / "work"
    for name, text in FAKE_FLASHINFER.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    built = work / ".cache/flashinfer/0.7.2.post1+test/90a/cached_ops"
    for module in ("batch_decode_bf16_hd128", "norm"):
        (built / module).mkdir(parents=True)
        (built / module / f"{module}.so").write_bytes(module.encode())
        (built / module / "build.ninja").write_text("not carried")
    given = site / "flashinfer/data/aot/sampling"
    given.mkdir(parents=True)
    (given / "sampling.so").write_bytes(b"sampling")
    done = gpu_check_function(tmp_path, site, work, tmp_path / "out", "harvest_kernels")
    assert done.returncode == 0 and "harvested 3 modules" in done.stdout, done.stdout + done.stderr

    next_repo = tmp_path / "next"
    cache = tmp_path / "cache" / "flashinfer-kernels.tar.gz"
    kept = stage.keep_kernels(tmp_path / "out" / "flashinfer-kernels.tar.gz", next_repo, cache)
    assert kept == next_repo / stage.KERNELS and cache.read_bytes() == kept.read_bytes()
    fresh = tmp_path / "fresh-site"
    shutil.copytree(site, fresh, ignore=shutil.ignore_patterns("data"))
    done = gpu_check_function(next_repo, fresh, tmp_path / "work2", tmp_path / "out2", "install_kernels")
    assert done.returncode == 0 and "3 prebuilt FlashInfer modules" in done.stdout, done.stdout + done.stderr
    aot = fresh / "flashinfer/data/aot"
    assert sorted(p.relative_to(aot).as_posix() for p in aot.rglob("*") if p.is_file()) == [
        "batch_decode_bf16_hd128/batch_decode_bf16_hd128.so", "norm/norm.so", "sampling/sampling.so"]

    (fresh / "flashinfer/__init__.py").write_text('__version__ = "0.7.3"\n')  # another FlashInfer: not used
    shutil.rmtree(aot)
    done = gpu_check_function(next_repo, fresh, tmp_path / "work2", tmp_path / "out2", "install_kernels")
    assert done.returncode == 0 and "not used" in done.stdout and not aot.exists(), done.stdout


def test_keep_kernels_refuses_what_no_harvest_wrote(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as tar:
        tar.add(__file__, arcname="x.so")
    with pytest.raises(ValueError, match="KERNELS_OF"):
        stage.keep_kernels(bogus, tmp_path / "repo", tmp_path / "cache.tar.gz")


def test_a_new_checkout_gets_the_cached_kernels(tmp_path: Path) -> None:
    """A session's clone has no .gpu_jit/ (git-ignored): staging restores the
    kernels an earlier session kept, and never overwrites a checkout's own."""
    cache, repo = tmp_path / "cache" / "k.tar.gz", tmp_path / "repo"
    assert stage.restore_kernels(repo, cache) is None and not (repo / stage.KERNELS).exists()  # nothing cached
    cache.parent.mkdir()
    cache.write_bytes(b"cached")
    assert stage.restore_kernels(repo, cache) == repo / stage.KERNELS
    assert (repo / stage.KERNELS).read_bytes() == b"cached"
    (repo / stage.KERNELS).write_bytes(b"own")
    assert stage.restore_kernels(repo, cache) is None and (repo / stage.KERNELS).read_bytes() == b"own"


def test_a_variant_carries_no_tokenizer_copy_and_unpacks_its_bases(tmp_path: Path) -> None:
    """prepare_models packs a variant's tokenizer as a pointer to its base;
    unpack_models on the GPU machine gives every folder a whole tokenizer.json."""
    import prepare_models

    source = tmp_path / "tokenizer-source"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}' * 1000)
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    repo = tmp_path / "repo"
    base_size = prepare_models.pack_model(source, repo / ".gpu_models" / "base")
    variant_size = prepare_models.pack_model(source, repo / ".gpu_models" / "variant", tokenizer_from="base")
    assert variant_size < 100 < base_size
    done = gpu_check_function(repo, tmp_path / "site", tmp_path / "work", tmp_path / "out", "unpack_models")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("base", "variant"):
        assert (repo / ".gpu_models" / name / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
