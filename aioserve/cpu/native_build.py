"""Runs the kernels' build (ninja over the system C++ compiler) in a child
process that leads its own session, so that no process of a build outlives it.

The parent writes build.ninja (write_ninja_file); the child runs `ninja`,
which starts each compiler command in a process group of its own. Killed
in the caller, a build would leave ninja and its compilers running under PID 1, still writing into the build folder that the next build
uses. Here the build runs in a child started with start_new_session: its pid
is its session's id, and ninja and every compiler stay in that session
(they change group, not session). The whole session is killed:

* by the parent, when the build is abandoned (an exception, Ctrl-C, a
  timeout) while the child still runs;
* by the child itself, when its stdin (a pipe from the parent) reaches EOF
  before the build is done: the parent died, even by SIGKILL, since the kernel
  closes a dead process's pipe ends.

The parent's build lock (an flock) is passed to the child, so it is held
until the child is gone: the next build cannot begin while this one's
compilers still run.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOG_NAME = "aioserve-build.log"
# ninja's status line for each finished command ("[3/7] g++ ..."): what the
# progress lines count units by (native_progress.py).
NINJA_STATUS = "[%f/%t] "


@dataclass
class BuildRequest:
    """What the child needs to run the build; sent to it as JSON."""

    folder: str
    jobs: int


def write_ninja_file(folder: Path, sources: list[Path], library: str, compiler: str, cflags: list[str],
                     ldflags: list[str]) -> int:
    """build.ninja in `folder`: one object per source, linked into `library`
    (written under a temporary name and renamed, so that a build killed
    midway never leaves a library behind). Returns the number of commands."""
    quote = shlex.join
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {shlex.quote(compiler)}",
        f"cflags = {quote(cflags)}",
        f"ldflags = {quote(ldflags)}",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        "  command = $cxx -shared $in $ldflags -o $out.tmp && mv -f $out.tmp $out",
    ]
    objects = []
    # Largest first: ninja starts them in this order, and the longest compile
    # (gemm.cpp) started last would run alone at the end.
    for source in sorted(sources, key=lambda path: path.stat().st_size, reverse=True):
        obj = f"{source.stem}.o"
        objects.append(obj)
        lines.append(f"build {obj}: compile {_escape(str(source))}")
    lines.append(f"build {library}: link {' '.join(objects)}")
    lines.append(f"default {library}")
    (folder / "build.ninja").write_text("\n".join(lines) + "\n")
    return len(objects) + 1


def _escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _session_members(sid: int) -> list[int]:
    """The pids of the processes in session `sid` (Linux's /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`, its leader (`sid` itself) last."""

    def kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # already gone
            pass

    inside = os.getsid(0) == sid
    if not inside:
        try:
            os.killpg(sid, signal.SIGKILL)  # the leader's group first: ninja starts no more compilers
        except (ProcessLookupError, PermissionError):
            pass
    if not Path("/proc/self/stat").exists():  # no /proc: the leader's group is what can be reached
        if inside:
            os.killpg(sid, signal.SIGKILL)
        return
    for _ in range(10):  # a process forked while we looked is caught on the next pass
        others = [pid for pid in _session_members(sid) if pid not in (sid, os.getpid())]
        if not others:
            break
        for pid in others:
            kill(pid)
    if os.getpid() != sid:
        kill(sid)


def build_in_own_session(
    request: BuildRequest, lock_fd: int, on_wait: Callable[[float], None] | None = None, poll_s: float = 1.0
) -> None:
    """Build in a child process session; raises RuntimeError (with the build's
    output) when the build fails. `on_wait(elapsed_s)` is called every poll_s
    while it runs (progress lines)."""
    log_path = Path(request.folder) / LOG_NAME
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # This file as a script (-I: isolated, its folder not on sys.path), not
        # `-m`: importing the aioserve package would import torch, seconds of CPU.
        child = subprocess.Popen(
            [sys.executable, "-I", __file__, json.dumps(asdict(request))],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=(lock_fd,),
        )
    try:
        while True:
            try:
                code = child.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                if on_wait is not None:
                    on_wait(time.monotonic() - started)
    finally:
        if child.poll() is None:  # abandoned midway: the child, ninja and the compilers go
            kill_session(child.pid)
            child.wait()
        if child.stdin is not None:
            child.stdin.close()
    if code != 0:
        output = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"building the native kernels failed (exit {code}); {log_path}:\n{output}")


def _die_with_parent() -> None:
    """Reads stdin until EOF; EOF before the build is done means the parent
    is gone: kill this whole session (ninja, the compilers, then this process)."""
    while os.read(0, 4096):  # the raw fd: no buffered reader's lock to trip the exit on
        pass
    kill_session(os.getsid(0))
    os.kill(os.getpid(), signal.SIGKILL)


def ninja_path() -> str:
    """The ninja a build runs: on PATH, or beside this Python (the pip
    package's, in a venv run by its full path)."""
    return shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))


def _main(argv: list[str]) -> int:
    request = BuildRequest(**json.loads(argv[0]))
    threading.Thread(target=_die_with_parent, name="aioserve-build-watch", daemon=True).start()
    sys.stdout.flush()
    env = {**os.environ, "NINJA_STATUS": NINJA_STATUS}
    return subprocess.run([ninja_path(), "-C", request.folder, "-j", str(request.jobs)], env=env).returncode


if __name__ == "__main__":
    code = _main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # at once: the watcher thread still blocks in read(), which a normal exit would wait on
