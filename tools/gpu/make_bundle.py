#!/usr/bin/env python3
"""Build `.whl/`: the wheels a GPU run installs offline next to the image's own packages.

The GPU machine (one H100, Python 3.12, torch 2.11+cu130, nvcc 13.0, no internet)
receives only the repository's working tree (64 MiB in all). This script, run on
a CPU machine with pip access:

1. downloads pinned wheels for CPython 3.12 / manylinux x86_64 (hash-checked);
2. rewrites flashinfer-python into a trimmed wheel that keeps only what the
   paths aioserve uses need (see README.md beside this file): every Python module
   reachable through an import statement from `flashinfer/__init__.py` (the
   package `__init__` is left untouched), the header trees the JIT puts on the
   include path, and only the csrc sources of the JIT modules listed in
   `KEPT_CSRC_SOURCES`;
3. writes them all into `.whl/` at the repository root, prints their sizes and
   fails when the total exceeds the budget.

`--check --site DIR` verifies an installed bundle without a GPU: it imports the
trimmed flashinfer, generates the JIT specs of the kernels aioserve uses
(nothing is compiled), and checks that every source and every header those
sources include (transitively) that the original wheel holds is still there.
"""

from __future__ import annotations

import argparse
import ast
import base64
import collections
import dataclasses
import hashlib
import importlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

LOG = logging.getLogger("make_bundle")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / ".whl"
DEFAULT_WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aioserve-gpu-bundle"
DEFAULT_BUDGET_MIB = 45.0
MIB = 1024 * 1024

# The GPU machine: /opt/torch/.venv/bin/python3 is CPython 3.12.3 on x86-64 Linux.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One pinned wheel of the bundle."""

    name: str
    version: str
    sha256: str
    why: str
    optional: bool = False

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


FLASHINFER = Requirement(
    "flashinfer-python",
    "0.7.2.post1",
    "bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49",
    "attention (decode/prefill), sampling, norm, rope, activation kernels; trimmed, see below",
)

# Everything below is missing from the GPU image (KINDS.md, "Python packages
# already there") or present there in a version too old for what needs it.
# Resolved with pip on 2026-11 for cp312 manylinux x86_64.
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        "apache-tvm-ffi", "0.1.15.post2",
        "059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b",
        "flashinfer.jit.core imports tvm_ffi at import time and loads every JIT module "
        "through it; xgrammar needs it too",
    ),
    Requirement(
        "xgrammar", "0.2.8",
        "4045b096735bb2523e0d874039a55994c1b390620d547c4a0d4f43b9a106177b",
        "aioserve.grammar imports it at module level (reached from aioserve.llm)",
    ),
    Requirement(
        "starlette", "1.10.0",
        "478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4",
        "aioserve.server (ASGI app)",
    ),
    Requirement(
        "hypercorn", "0.18.0",
        "225e268f2c1c2f28f6d8f6db8f40cb8c992963610c5725e13ccfcddccb24b1cd",
        "aioserve.server (HTTP server)",
    ),
    Requirement(
        "h11", "0.16.0",
        "63cf8bbe7522de3bf65932fda1d9c2772064ffb3dae62d55932da54b31cb6c86",
        "hypercorn/wsproto need h11>=0.16; the image has h11 of unknown version",
    ),
    Requirement(
        "h2", "4.4.1",
        "0e25f1462b23c9cb82d9eb02e28bc706dac2a68cb457c6a0d74d63c8a2a5d0e6",
        "hypercorn",
    ),
    Requirement(
        "hpack", "4.2.0",
        "858ac0b02280fa582b5080d68db0899c62a80375e0e5413a74970c5e518b6986",
        "h2",
    ),
    Requirement(
        "hyperframe", "6.1.0",
        "b03380493a519fce58ea5af42e4a42317bf9bd425596f7a0835ffce80f1a42e5",
        "h2",
    ),
    Requirement(
        "priority", "2.0.0",
        "6f8eefce5f3ad59baf2c080a664037bb4725cd0a790d53d59ab4059288faf6aa",
        "hypercorn",
    ),
    Requirement(
        "wsproto", "1.3.2",
        "61eea322cdf56e8cc904bd3ad7573359a242ba65688716b0710a5eb12beab584",
        "hypercorn",
    ),
    Requirement(
        "pydantic", "2.14.3",
        "3f7b347782ab7e4cf4c798496ae3a82787d9f21ec12676a9c564355eeef8daa8",
        "aioserve request/response models; xgrammar",
    ),
    Requirement(
        "pydantic-core", "2.50.4",
        "c81d98e27d9d9261909dcccab1ba5d6ea1c98b0bb9470e368604614fd1d36ddd",
        "pydantic (exact pin)",
    ),
    Requirement(
        "annotated-types", "0.8.0",
        "f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0",
        "pydantic",
    ),
    Requirement(
        "typing-inspection", "0.4.5",
        "bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39",
        "pydantic",
    ),
    Requirement(
        "typing-extensions", "4.16.0",
        "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8",
        "pydantic-core needs >=4.16.0; the image's version is unknown",
    ),
    # Test-only (pyproject's `test` extra); small, so carried by default.
    Requirement(
        "openai", "3.54.0",
        "3cdb7d0d85bb765c7c92e7e2922c4a6cb9beb085b161b03da07f4dff61805916",
        "tests: OpenAI client against the server", optional=True,
    ),
    Requirement(
        "httpx2", "2.16.2",
        "f05c13aade4c45dbf1c9060647a1058f0acad62398fad96e741269edb33d46f5",
        "openai", optional=True,
    ),
    Requirement(
        "httpcore2", "2.16.2",
        "16051ae2a42f776007543f32de9349a317b23d2cbb4e1456b4bac0e88b87419a",
        "httpx2", optional=True,
    ),
    Requirement(
        "truststore", "0.10.5",
        "9aaaedaefaf06d8b206278cf8b5012bc897f485a874503501e12d776df78951c",
        "httpx2", optional=True,
    ),
    Requirement(
        "jiter", "0.19.0",
        "0956b5f58b804221dfb929c120e6d4032138fed20c1cc0ef683a2d1326255e46",
        "openai", optional=True,
    ),
    Requirement(
        "distro", "1.9.0",
        "7bffd925d65168f85027d8da9af6bddab658135b840670a223589bc0c8ef02b2",
        "openai", optional=True,
    ),
    Requirement(
        "sniffio", "1.3.1",
        "2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2",
        "openai", optional=True,
    ),
    Requirement(
        "anyio", "4.16.0",
        "c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026",
        "openai/httpx2 need anyio>=4.10; the image has anyio of unknown version",
        optional=True,
    ),
    Requirement(
        "idna", "3.20",
        "ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c",
        "httpx2 needs idna>=3.18", optional=True,
    ),
    Requirement(
        "jsonschema", "4.26.0",
        "d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce",
        "tests/test_openapi_spec.py", optional=True,
    ),
    Requirement(
        "jsonschema-specifications", "2025.9.1",
        "98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe",
        "jsonschema", optional=True,
    ),
    Requirement(
        "referencing", "0.37.0",
        "381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231",
        "tests/test_openapi_spec.py; jsonschema", optional=True,
    ),
    Requirement(
        "rpds-py", "2026.9.1",
        "addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab",
        "jsonschema/referencing", optional=True,
    ),
)

# Local version label of the rewritten wheel, so nobody takes it for the real one.
# `flashinfer.__version__` (from flashinfer/_build_meta.py) and hence the JIT
# cache directory keep the upstream version.
TRIM_LABEL = "aioserve.sm90trim"

# Python roots of the trimmed package: the untouched `flashinfer/__init__.py`
# imports nearly every subpackage, and `flashinfer.__main__` is the console script.
PYTHON_ROOTS: tuple[str, ...] = ("flashinfer", "flashinfer.__main__")

# Header trees, relative to flashinfer/data/, kept whole: they are the include
# path of every JIT module (flashinfer/jit/env.py, jit/cpp_ext.py), and CUTLASS /
# CCCL include headers through macros (CUDA_STD_HEADER(...)) that no static scan
# follows, so trimming inside them is not worth the risk.
KEPT_DATA_TREES: tuple[str, ...] = (
    "include/",
    "cutlass/include/",
    "cutlass/tools/util/include/",
    "cccl/cub/cub/",
    "cccl/libcudacxx/include/",
    "cccl/thrust/thrust/",
    "spdlog/include/",
)

# csrc translation units the JIT generators of the kept kernels copy or compile
# (flashinfer/jit/attention/modules.py, jit/sampling.py, jit/norm.py, jit/rope.py,
# jit/page.py; jit/activation.py generates its source from a Python string).
# Every top-level csrc file that is not a .cu (headers, .jinja templates) is kept too.
KEPT_CSRC_SOURCES: tuple[str, ...] = (
    # BatchDecodeWithPagedKVCacheWrapper (fa2 decode kernels)
    "batch_decode.cu",
    "batch_decode_jit_binding.cu",
    # BatchPrefillWithPagedKVCacheWrapper, fa2 (also decode with use_tensor_cores=True)
    "batch_prefill.cu",
    "batch_prefill_jit_binding.cu",
    "batch_prefill_paged.cu",
    "batch_prefill_paged_jit_binding.cu",
    # BatchPrefillWithPagedKVCacheWrapper, fa3 (backend="auto" picks it on sm_90)
    "batch_prefill_sm90.cu",
    "batch_prefill_sm90_jit_binding.cu",
    # flashinfer.sampling
    "sampling.cu",
    "renorm.cu",
    "flashinfer_sampling_binding.cu",
    # flashinfer.norm (CUDA JIT path; the CuTe-DSL path needs nvidia-cutlass-dsl)
    "norm.cu",
    "flashinfer_norm_binding.cu",
    # flashinfer.rope
    "rope.cu",
    "flashinfer_rope_binding.cu",
    # flashinfer.page (append_paged_kv_cache)
    "page.cu",
    "flashinfer_page_binding.cu",
    # flashinfer.quantization.segment_packbits: the prefill wrapper's plan()
    # packs a custom mask with it (Gemma 3's bidirectional image spans)
    "quantization.cu",
    "flashinfer_quantization_binding.cu",
)

PKG_PREFIX = "flashinfer/"
DATA_PREFIX = "flashinfer/data/"
CSRC_PREFIX = "flashinfer/data/csrc/"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


# ----------------------------------------------------------------------------
# Downloading
# ----------------------------------------------------------------------------


def selected_requirements(include_optional: bool) -> list[Requirement]:
    """The non-FlashInfer wheels to carry."""
    return [r for r in REQUIREMENTS if include_optional or not r.optional]


def write_hashed_requirements(requirements: Sequence[Requirement], path: Path) -> None:
    """A pip requirements file pinning versions and sha256 hashes."""
    lines = [f"{r.pin} --hash=sha256:{r.sha256}" for r in requirements]
    path.write_text("\n".join(lines) + "\n")


def pip_download(requirements: Sequence[Requirement], dest: Path) -> None:
    """Download the pinned wheels for the GPU machine's interpreter and platform."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.txt"
        write_hashed_requirements(requirements, req_file)
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet",
            "--no-deps", "--only-binary=:all:", "--require-hashes",
            "--python-version", TARGET_PYTHON, "--implementation", "cp",
            *[arg for plat in TARGET_PLATFORMS for arg in ("--platform", plat)],
            "-d", str(dest), "-r", str(req_file),
        ]
        LOG.info("pip download %d wheels into %s", len(requirements), dest)
        subprocess.run(cmd, check=True)


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def find_wheel(directory: Path, requirement: Requirement) -> Path:
    """The downloaded wheel of a requirement (matched by name and version)."""
    for path in sorted(directory.glob("*.whl")):
        dist, version = path.name.split("-")[:2]
        if canonical(dist) == canonical(requirement.name) and version == requirement.version:
            return path
    raise FileNotFoundError(f"no wheel for {requirement.pin} in {directory}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def obtain_flashinfer_wheel(work: Path, local_wheel: Path | None) -> Path:
    """The original flashinfer-python wheel: a given local copy or a download."""
    if local_wheel is not None:
        actual = sha256_file(local_wheel)
        if actual != FLASHINFER.sha256:
            raise SystemExit(f"{local_wheel}: sha256 {actual} != pinned {FLASHINFER.sha256}")
        return local_wheel
    pip_download([FLASHINFER], work / "download")
    return find_wheel(work / "download", FLASHINFER)


# ----------------------------------------------------------------------------
# The Python part of FlashInfer: static import closure
# ----------------------------------------------------------------------------


def module_of(member: str) -> str:
    """Dotted module name of a .py archive member (packages without `.__init__`)."""
    dotted = member[: -len(".py")].replace("/", ".")
    return dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


def python_members(names: Iterable[str]) -> dict[str, str]:
    """Module name -> archive member for every FlashInfer .py outside data/."""
    return {
        module_of(n): n
        for n in names
        if n.startswith(PKG_PREFIX) and n.endswith(".py") and not n.startswith(DATA_PREFIX)
    }


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute base module of a `from X import ...` statement."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an import statement anywhere in a file may load.

    Function-level and conditional imports count: the closure must hold every
    module a kept code path can import lazily. `from a import b` yields both
    `a` and `a.b` (b may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(module, is_package, node)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def python_closure(archive: zipfile.ZipFile, roots: Sequence[str]) -> set[str]:
    """Archive members of the FlashInfer modules reachable by imports from `roots`."""
    members = python_members(archive.namelist())
    kept: set[str] = set()
    pending = list(roots)
    while pending:
        parts = pending.pop().split(".")
        for i in range(1, len(parts) + 1):  # a module's parent packages load first
            name = ".".join(parts[:i])
            member = members.get(name)
            if member is None or member in kept:
                continue
            kept.add(member)
            source = archive.read(member).decode("utf-8")
            found = imported_names(source, name, member.endswith("__init__.py"))
            pending.extend(n for n in found if n == "flashinfer" or n.startswith("flashinfer."))
    return kept


# ----------------------------------------------------------------------------
# The C++/CUDA part of FlashInfer: data/ selection
# ----------------------------------------------------------------------------


def is_kept_data(member: str) -> bool:
    """Whether a flashinfer/data/ member is needed by the kept JIT modules."""
    rel = member[len(DATA_PREFIX):]
    if rel.startswith(KEPT_DATA_TREES):
        return True
    if member.startswith(CSRC_PREFIX):
        name = member[len(CSRC_PREFIX):]
        top_level = "/" not in name
        return top_level and (not name.endswith(".cu") or name in KEPT_CSRC_SOURCES)
    return False


def dist_info_dir(names: Iterable[str]) -> str:
    """The `<name>-<version>.dist-info/` prefix of a wheel."""
    found = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    if len(found) != 1:
        raise ValueError(f"expected one .dist-info directory, found {sorted(found)}")
    return found.pop() + "/"


def select_members(archive: zipfile.ZipFile) -> list[str]:
    """Archive members of the trimmed wheel (the dist-info is rewritten separately)."""
    names = archive.namelist()
    dist_info = dist_info_dir(names)
    python = python_closure(archive, PYTHON_ROOTS)
    kept = [
        n for n in names
        if not n.endswith("/")
        and (n in python or (n.startswith(DATA_PREFIX) and is_kept_data(n)))
    ]
    licenses = [n for n in names if n.startswith(dist_info + "licenses/") and not n.endswith("/")]
    for csrc in KEPT_CSRC_SOURCES:
        if CSRC_PREFIX + csrc not in names:
            raise ValueError(f"{csrc} is not in the wheel: update KEPT_CSRC_SOURCES")
    return sorted(kept) + sorted(licenses)


# ----------------------------------------------------------------------------
# Writing a valid wheel
# ----------------------------------------------------------------------------


def trimmed_version(version: str) -> str:
    return f"{version}+{TRIM_LABEL}"


def rewrite_metadata(metadata: str, new_version: str) -> str:
    """METADATA with the new version and a note on what was removed."""
    lines = metadata.split("\n")
    out: list[str] = []
    for line in lines:
        if line.startswith("Version: "):
            line = f"Version: {new_version}"
        out.append(line)
        if line.startswith("Summary: "):
            out[-1] = (
                line + " [trimmed by aioserve tools/gpu/make_bundle.py: JIT sources "
                "for fa2/fa3 paged attention, sampling, norm, rope, activation, page only]"
            )
    return "\n".join(out)


def record_line(name: str, data: bytes) -> str:
    """One RECORD row: path, urlsafe-base64 sha256 without padding, size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_record(files: Mapping[str, bytes], record_name: str) -> bytes:
    """RECORD listing every file with its hash, and itself without one."""
    rows = [record_line(name, data) for name, data in files.items()]
    rows.append(f"{record_name},,")
    return ("\n".join(rows) + "\n").encode()


def write_zip(path: Path, files: Mapping[str, bytes]) -> None:
    """A deterministic wheel archive: files in the given order, fixed timestamps."""
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            out.writestr(info, data, compresslevel=9)
    tmp.replace(path)


def trim_flashinfer(original: Path, out_dir: Path) -> Path:
    """Write the trimmed flashinfer wheel into `out_dir` and return its path."""
    with zipfile.ZipFile(original) as archive:
        old_dist_info = dist_info_dir(archive.namelist())
        dist, version = old_dist_info[: -len(".dist-info/")].split("-")
        new_version = trimmed_version(version)
        new_dist_info = f"{dist}-{new_version}.dist-info/"
        files: dict[str, bytes] = {}
        for name in select_members(archive):
            new_name = name.replace(old_dist_info, new_dist_info, 1)
            files[new_name] = archive.read(name)
        metadata = archive.read(old_dist_info + "METADATA").decode("utf-8")
        files[new_dist_info + "METADATA"] = rewrite_metadata(metadata, new_version).encode()
        files[new_dist_info + "WHEEL"] = archive.read(old_dist_info + "WHEEL")
        files[new_dist_info + "entry_points.txt"] = archive.read(old_dist_info + "entry_points.txt")
        files[new_dist_info + "top_level.txt"] = b"flashinfer\n"
    record_name = new_dist_info + "RECORD"
    files[record_name] = build_record(files, record_name)
    path = out_dir / f"{dist}-{new_version}-py3-none-any.whl"
    write_zip(path, files)
    LOG.info("trimmed %s -> %s (%d files)", original.name, path.name, len(files))
    return path


def trim_area(member: str) -> str:
    """Coarse area of an archive member, for the before/after summary."""
    if member.startswith(DATA_PREFIX):
        return "/".join(member.split("/")[:4])
    if member.startswith(PKG_PREFIX):
        return "flashinfer/**.py" if member.endswith(".py") else "flashinfer/** (other files)"
    return member.split("/")[0]


def area_sizes(wheel: Path) -> collections.Counter[str]:
    """Uncompressed bytes per area of a wheel."""
    sizes: collections.Counter[str] = collections.Counter()
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            sizes[trim_area(info.filename)] += info.file_size
    return sizes


def summarize_trim(original: Path, trimmed: Path) -> None:
    """Log the largest areas of the original wheel and what is left of them."""
    before, after = area_sizes(original), area_sizes(trimmed)
    for key in sorted(before, key=lambda k: -before[k])[:14]:
        LOG.info("  %-40s %7.1f MiB -> %6.1f MiB (uncompressed)", key, before[key] / MIB, after.get(key, 0) / MIB)


# ----------------------------------------------------------------------------
# Assembling .whl/
# ----------------------------------------------------------------------------


def clear_wheels(out_dir: Path) -> None:
    """Remove the previous bundle's wheels (only *.whl) from the output folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.whl"):
        old.unlink()


def copy_wheel(source: Path, out_dir: Path) -> Path:
    target = out_dir / source.name
    target.write_bytes(source.read_bytes())
    return target


def size_table(wheels: Sequence[Path], optional_names: set[str]) -> tuple[str, int]:
    """A printable table of the bundle's files and their total size in bytes."""
    rows = []
    total = 0
    for wheel in sorted(wheels, key=lambda p: -p.stat().st_size):
        size = wheel.stat().st_size
        total += size
        dist = canonical(wheel.name.split("-")[0])
        tag = "optional (tests)" if dist in optional_names else "required"
        rows.append(f"{size / MIB:9.2f} MiB  {tag:17s} {wheel.name}")
    rows.append(f"{total / MIB:9.2f} MiB  total ({len(wheels)} wheels)")
    return "\n".join(rows), total


def build_bundle(args: argparse.Namespace) -> int:
    """Download, trim, assemble and budget-check the bundle."""
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    original = obtain_flashinfer_wheel(work, args.flashinfer_wheel)
    others = selected_requirements(not args.no_optional)
    pip_download(others, work / "download")
    clear_wheels(args.out)
    wheels = [trim_flashinfer(original, args.out)]
    summarize_trim(original, wheels[0])
    wheels += [copy_wheel(find_wheel(work / "download", r), args.out) for r in others]
    optional_names = {canonical(r.name) for r in others if r.optional}
    table, total = size_table(wheels, optional_names)
    print(table)
    if optional_names:
        print("optional (test-only; leave out with --no-optional):", ", ".join(sorted(optional_names)))
    budget = int(args.budget_mib * MIB)
    if total > budget:
        LOG.error("bundle is %.2f MiB, over the %.2f MiB budget", total / MIB, args.budget_mib)
        return 1
    LOG.info("bundle is %.2f MiB, within the %.2f MiB budget", total / MIB, args.budget_mib)
    return 0


# ----------------------------------------------------------------------------
# --check: verify an installed bundle without a GPU
# ----------------------------------------------------------------------------

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def prepare_check_environment(sites: Sequence[Path], workspace: Path) -> None:
    """sys.path and environment for importing the installed bundle on a CPU machine."""
    for site in reversed(sites):
        sys.path.insert(0, str(site))
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    if "CUDA_HOME" not in os.environ and not any(
        (Path(p) / "nvcc").exists() for p in os.environ.get("PATH", "").split(os.pathsep)
    ):
        os.environ["CUDA_HOME"] = str(make_stub_cuda_home(workspace / "stub-cuda"))


def make_stub_cuda_home(root: Path) -> Path:
    """A CUDA_HOME whose nvcc only answers --version (13.0, as on the GPU machine).

    FlashInfer asks nvcc for its version while writing build.ninja files; nothing
    is compiled here."""
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text('#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    nvcc.chmod(0o755)
    (root / "include").mkdir(exist_ok=True)
    return root


def import_entry_points() -> Any:
    """Import flashinfer and the submodules aioserve uses; return the package."""
    flashinfer = importlib.import_module("flashinfer")
    from flashinfer import (  # noqa: F401
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
    )
    for name in ("sampling", "norm", "rope", "activation", "page", "decode", "prefill"):
        importlib.import_module(f"flashinfer.{name}")
    for fn in (
        "top_k_top_p_sampling_from_probs", "min_p_sampling_from_probs",
        "top_k_sampling_from_probs", "top_p_sampling_from_probs",
        "rmsnorm", "fused_add_rmsnorm", "apply_rope_with_cos_sin_cache_inplace",
        "silu_and_mul", "append_paged_kv_cache",
    ):
        getattr(flashinfer, fn)
    return flashinfer


def third_party_imports(before: set[str], after: set[str]) -> list[str]:
    """Top-level non-stdlib packages first imported between two sys.modules snapshots."""
    new = {m.split(".")[0] for m in after - before}
    return sorted(new - set(sys.stdlib_module_names) - {"flashinfer", "torch", "__main__", "__mp_main__"})


def record_jit_specs() -> list[Any]:
    """Run the module getters aioserve's calls go through, with compilation stubbed.

    Each getter generates its sources (jinja templates, copied csrc files) into
    the workspace and returns a JitSpec; `build_and_load` is replaced so nothing
    is compiled or loaded."""
    import unittest.mock

    import torch
    from flashinfer import activation, decode, norm, page, prefill, rope, sampling
    from flashinfer.jit import core

    # the module, not the function `flashinfer.quantization` re-exports under its name
    packbits = importlib.import_module("flashinfer.quantization.packbits")

    def fake_build_and_load(self: Any) -> Any:
        return unittest.mock.MagicMock(name=self.name)

    core.JitSpec.build_and_load = fake_build_and_load  # type: ignore[method-assign]
    core.JitSpecNvcc.build_and_load = fake_build_and_load  # type: ignore[method-assign]
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            decode.get_batch_decode_module(dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)
            for backend in ("fa2", "fa3"):
                prefill.get_batch_prefill_module(
                    backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False
                )
    sampling.get_sampling_module()
    norm.get_norm_module()
    rope.get_rope_module()
    activation.get_act_and_mul_module("silu")
    page.get_page_module()
    packbits.get_quantization_module()
    return list(core.jit_spec_registry.get_all_specs().values())


def include_roots(data_dir: Path) -> list[Path]:
    """The include path FlashInfer's JIT uses, in order (jit/cpp_ext.py)."""
    return [
        data_dir / "cccl" / "cub",
        data_dir / "cccl" / "libcudacxx" / "include",
        data_dir / "cccl" / "thrust",
        data_dir / "include",
        data_dir / "csrc",
        data_dir / "cutlass" / "include",
        data_dir / "cutlass" / "tools" / "util" / "include",
        data_dir / "spdlog" / "include",
    ]


def reference_paths(reference_wheel: Path) -> set[str]:
    """Paths (relative to flashinfer/data/) of the original wheel's data files."""
    with zipfile.ZipFile(reference_wheel) as archive:
        return {n[len(DATA_PREFIX):] for n in archive.namelist() if n.startswith(DATA_PREFIX)}


def resolve_include(
    name: str, quoted: bool, including: Path, roots: Sequence[Path]
) -> Path | None:
    """First existing file an #include resolves to, or None."""
    candidates = ([including.parent] if quoted else []) + list(roots)
    for directory in candidates:
        path = Path(os.path.normpath(directory / name))
        if path.is_file():
            return path
    return None


def in_reference(
    name: str, quoted: bool, including: Path, data_dir: Path, reference: set[str]
) -> str | None:
    """Where the original wheel would have resolved an include (relative to data/)."""
    rel_roots = [str(r.relative_to(data_dir)) for r in include_roots(data_dir)]
    candidates = list(rel_roots)
    if quoted and including.is_relative_to(data_dir):
        candidates.insert(0, str(including.parent.relative_to(data_dir)))
    for root in candidates:
        rel = os.path.normpath(os.path.join(root, name))
        if rel in reference:
            return rel
    return None


def walk_includes(
    sources: Iterable[Path], data_dir: Path, reference: set[str] | None
) -> tuple[set[Path], list[str], set[str]]:
    """Transitive #include closure of the sources (every branch of every #if).

    Returns the files reached, the problems (missing sources, includes the
    original wheel resolves but the trimmed one does not), and the includes
    resolved by neither (toolkit, libc++/libstdc++ and tvm-ffi headers, or
    headers only under dead #if branches)."""
    roots = include_roots(data_dir)
    seen: set[Path] = set()
    problems: list[str] = []
    external: set[str] = set()
    pending = list(sources)
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.is_file():
            problems.append(f"missing source {path}")
            continue
        for kind, name in INCLUDE_RE.findall(path.read_text(errors="replace")):
            quoted = kind == '"'
            found = resolve_include(name, quoted, path, roots)
            if found is not None:
                pending.append(found)
                continue
            original = in_reference(name, quoted, path, data_dir, reference) if reference else None
            if original is not None:
                problems.append(f"{path.name}: #include {name} -> trimmed away (data/{original})")
            else:
                external.add(name)
    return seen, problems, external


def ninja_include_dirs(spec: Any) -> list[Path]:
    """-I/-isystem directories in a spec's generated build.ninja."""
    spec.write_ninja()
    text = Path(spec.ninja_path).read_text()
    return [Path(p) for p in re.findall(r"(?:-I|-isystem )(\S+)", text)]


def check_specs(specs: Sequence[Any], data_dir: Path, reference: set[str] | None) -> list[str]:
    """Problems found in the specs' sources, include closure and include dirs."""
    problems: list[str] = []
    sources = [Path(s) for spec in specs for s in spec.sources]
    reached, include_problems, external = walk_includes(sources, data_dir, reference)
    problems += include_problems
    for spec in specs:
        for directory in ninja_include_dirs(spec):
            if str(directory).startswith(str(data_dir)) and not directory.is_dir():
                problems.append(f"{spec.name}: include dir {directory} is missing")
    in_data = [p for p in reached if p.is_relative_to(data_dir)]
    LOG.info(
        "%d JIT specs, %d sources; include closure: %d files in flashinfer/data, "
        "%d include names resolved outside it (toolkit/system/tvm-ffi or dead #if branches)",
        len(specs), len(sources), len(in_data), len(external),
    )
    return problems


def run_check(args: argparse.Namespace) -> int:
    """Import the installed bundle and walk the JIT specs aioserve needs."""
    before = set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="fi-check-") as tmp:
        prepare_check_environment(args.site, Path(tmp))
        import torch

        after_torch = set(sys.modules)
        flashinfer = import_entry_points()
        after_flashinfer = set(sys.modules)
        LOG.info("flashinfer %s from %s; torch %s", flashinfer.__version__, flashinfer.__file__, torch.__version__)
        LOG.info("imported by `import torch`: %s", third_party_imports(before, after_torch))
        LOG.info("then by flashinfer: %s", third_party_imports(after_torch, after_flashinfer))
        norm_module = importlib.import_module("flashinfer.norm")
        LOG.info("flashinfer.norm uses the CUDA JIT kernels (no CuTe DSL): %s", norm_module._USE_CUDA_NORM)
        specs = record_jit_specs()
        data_dir = Path(flashinfer.__file__).parent / "data"
        reference = reference_paths(args.reference_wheel) if args.reference_wheel else None
        if reference is None:
            LOG.warning("no --reference-wheel: trimmed-away headers cannot be told from system ones")
        problems = check_specs(specs, data_dir, reference)
    for problem in problems:
        LOG.error("%s", problem)
    if problems:
        return 1
    LOG.info("check passed")
    return 0


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: <repo>/.whl)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="download cache (default: %(default)s)")
    parser.add_argument("--budget-mib", type=float, default=DEFAULT_BUDGET_MIB, help="fail above this total")
    parser.add_argument("--flashinfer-wheel", type=Path, help="use this local flashinfer-python wheel (hash-checked)")
    parser.add_argument("--no-optional", action="store_true", help="leave out the test-only wheels")
    parser.add_argument("--check", action="store_true", help="verify an installed bundle instead of building")
    parser.add_argument("--site", type=Path, action="append", default=[], help="--check: folder(s) to put first on sys.path")
    parser.add_argument("--reference-wheel", type=Path, help="--check: the original flashinfer-python wheel")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.check:
        return run_check(args)
    return build_bundle(args)


if __name__ == "__main__":
    sys.exit(main())
