"""The forward thread keeps its thread count while the event loop's thread
runs its own torch ops on one thread, and serving leaves no OpenMP team on
the loop's thread (see aioserve/cpu/openmp.py for why either would cost a CPU
step half its speed)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from aioserve import LLM, SamplingParams
from aioserve.cpu.openmp import this_thread_single_threaded


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_the_loop_thread_is_single_threaded_only_for_itself() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    with this_thread_single_threaded():
        inside = torch.get_num_threads()
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join()
    assert torch.get_num_threads() == before
    if before > 1 and inside == 1:  # an OpenMP runtime was found (Linux builds of torch)
        assert seen == [before]  # another thread is untouched


def test_serving_keeps_the_forward_threads_count(tiny_checkpoints: dict[str, Path]) -> None:
    wanted = torch.get_num_threads()
    llm = LLM(str(tiny_checkpoints["llama"]), page_size=4, device="cpu")
    forward = llm.scheduler.executor._thread  # the thread every step runs on
    prompts = [[5 + i] * 40 for i in range(24)]  # enough rows for ops that go parallel
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    threads = _threads()
    for _ in range(2):
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert forward.submit(torch.get_num_threads).result() == wanted
    assert torch.get_num_threads() == wanted  # the caller's setting is given back
    assert _threads() == threads  # no new OpenMP team anywhere
    llm.close()


BUILD_SCHEDULER = """
import os, sys, threading
import torch
from aioserve.config import EngineConfig
from aioserve.scheduler.scheduler import ModelFacts, Scheduler

config = EngineConfig(model=sys.argv[1], device="cpu")
facts = ModelFacts(
    num_pages=8192, page_size=16, max_model_len=1 << 17, vocab_size=1000, eos_token_ids=[2], max_prefill_tokens=256
)
started = []

def build():  # on a fresh thread: the main thread may have a team already
    torch.get_num_threads()  # ATen's own first-use setup, before looking
    before = set(os.listdir("/proc/self/task"))
    Scheduler(config, facts, executor=None)
    started.append(sorted(set(os.listdir("/proc/self/task")) - before))

builder = threading.Thread(target=build)
builder.start()
builder.join()
print(started[0])
"""


def test_building_the_scheduler_starts_no_team(tiny_checkpoints: dict[str, Path]) -> None:
    """A long context makes the page table (max requests x pages per
    request) big enough that zeroing it would run in parallel, leaving an
    OpenMP team on the thread that builds the scheduler: the event loop's.
    Checked in a process of its own: what the test process imported before
    (scikit-learn, through sentence-transformers, brings its own OpenMP
    runtime) must not decide it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BUILD_SCHEDULER, str(tiny_checkpoints["llama"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"  # a team would have started worker threads
