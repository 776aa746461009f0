"""`aioserve serve --dp N`: the replicas' flags (the parent's, less --dp),
their ports, devices and threads, the router's command line; and a real
`--dp 2` deployment: it answers on the public port, both replicas serve, a
replica killed is restarted (requests meanwhile go to the other), --api-key
holds through the router, and neither the replicas nor the router outlive
the parent, however it ends. Also: both programs take the flags of
deploy/kubernetes.yaml."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_process import free_port, free_port_run

from aioserve.cli import parse_serve_args, serve_argv
from aioserve.data_parallel import ROUTER_FAILOVER_FLAGS, replica_args, replica_ports, router_command

MODEL_NAME = "stories260K"


def test_serve_argv_gives_back_the_same_args() -> None:
    flags = [
        "--dp", "2", "--tp", "2", "--kv-cache-memory", "1GiB", "--disable-overlap", "--max-waiting-requests", "5",
        "--port", "9000", "--router-args=--disable-retries", "--served-model-name", "m", "--access-log",
    ]
    args = parse_serve_args(flags)
    assert parse_serve_args(serve_argv(args)) == args
    assert serve_argv(parse_serve_args([])) == []  # defaults are not spelled out


def test_replicas_get_loopback_ports_and_a_share_of_the_cores() -> None:
    args = parse_serve_args(["--dp", "2", "--host", "0.0.0.0", "--port", "9000", "--device", "cpu",
                             "--router-args=--disable-retries"])
    assert replica_ports(args) == [9001, 9002]
    assert replica_ports(parse_serve_args(["--dp", "3", "--dp-base-port", "7000"])) == [7000, 7001, 7002]
    replica = replica_args(args, 1, 9002)
    assert (replica.host, replica.port, replica.dp_size, replica.router_args) == ("127.0.0.1", 9002, 1, None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert replica.engine.num_threads == max(1, cores // 2)
    assert "--dp-size" not in " ".join(serve_argv(replica))


def test_the_router_command() -> None:
    args = parse_serve_args(["--dp", "2", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
                             "--router-policy", "round_robin", "--router-args", "--health-check-interval-secs 5"])
    command = router_command(args, ["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    assert command[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    text = " ".join(command)
    assert "--host 0.0.0.0 --port 9000 --prometheus-host 0.0.0.0" in text
    assert "--worker-urls http://127.0.0.1:9001 http://127.0.0.1:9002" in text
    assert "--policy round_robin" in text and "--api-key k" in text
    assert " ".join(ROUTER_FAILOVER_FLAGS) in text
    assert command[-2:] == ["--health-check-interval-secs", "5"]  # last: it overrides the failover flags


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(condition, timeout: float, what: str | Callable[[], str]) -> None:  # type: ignore[no-untyped-def]
    """Until `condition()`; else fail with `what` (a callable is read at the
    failure, e.g. a log as it then stands)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


def _completion(url: str, prompt: str, api_key: str | None = None) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def _ready(url: str, api_key: str | None = None) -> bool:
    try:
        return _completion(url, "ready?", api_key).status_code == 200
    except httpx.HTTPError:
        return False


def _replica_pid(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/server_info", timeout=5).json()["tensor_parallel"]["ranks"][0]["pid"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _start_dp_2(
    stories_path: Path, *flags: str, api_key: str | None = None, ready=None
) -> tuple[subprocess.Popen, str, list[str], Path]:
    """`aioserve serve --dp 2 [flags]` on the CPU (a GPU machine may have one
    GPU), once it answers (`ready(url)`, by default a completion): the
    process, its URL, the replicas' URLs, its log."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed: pip install -e '.[router]'")
    # The replicas listen on base and base + 1, the merged /metrics on base + 2.
    base = free_port_run(3)
    port = free_port()
    while base <= port <= base + 2:
        port = free_port()
    log = Path(tempfile.mkstemp(prefix="aioserve-dp-", suffix=".log")[1])
    command = [
        sys.executable, "-m", "aioserve", "serve", "--model", str(stories_path), "--served-model-name", MODEL_NAME,
        "--dp", "2", "--port", str(port), "--dp-base-port", str(base), "--device", "cpu", "--num-threads", "1",
        "--router-args", f"--prometheus-port {free_port()} --prometheus-host 127.0.0.1", *flags,
    ]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        parent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        answers = (lambda: ready(url)) if ready is not None else (lambda: _ready(url, api_key))
        # A parent that exits (a replica that could not start) fails at once, with its log.
        _wait(lambda: parent.poll() is not None or answers(), 120,
              lambda: f"--dp 2 did not answer:\n{log.read_text()[-3000:]}")
        assert parent.poll() is None, f"--dp 2 exited with status {parent.returncode}:\n{log.read_text()[-3000:]}"
    except BaseException:
        parent.kill()
        parent.wait()
        raise
    return parent, url, [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"], log


LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's"
)


def test_merged_metrics_label_each_replica_and_keep_families_whole() -> None:
    from aioserve.dp_metrics import labelled, merged

    assert labelled('a_total{x="1"} 3', 0) == 'a_total{replica="0",x="1"} 3'
    assert labelled("b 2.5", 1) == 'b{replica="1"} 2.5' and labelled("c{} 1", 2) == 'c{replica="2"} 1'
    one = "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n# HELP g G.\n# TYPE g gauge\ng{k=\"v\"} 2\n"
    text = merged([one, None, one.replace(" 1\n", " 5\n")])
    lines = text.splitlines()
    assert lines.count("# TYPE a_total counter") == 1 and lines.count("# TYPE g gauge") == 1
    start = lines.index("# TYPE a_total counter")
    assert lines[start + 1 : start + 3] == ['a_total{replica="0"} 1', 'a_total{replica="2"} 5']  # together
    assert 'aioserve:dp_replica_up{replica="1"} 0' in lines and 'aioserve:dp_replica_up{replica="0"} 1' in lines


@LINUX_ONLY
def test_dp_2_serves_restarts_a_replica_and_dies_with_its_parent(stories_path: Path) -> None:
    metrics_port = free_port()
    parent, url, replicas, log = _start_dp_2(stories_path, "--dp-metrics-port", str(metrics_port))
    try:
        children = _children(parent.pid)
        assert len(children) == 3, children  # two replicas and the router
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text  # where a scraper looks
        for replica in ("0", "1"):
            assert f'aioserve:dp_replica_up{{replica="{replica}"}} 1' in scraped
            assert f'aioserve:num_requests_running{{replica="{replica}"' in scraped, scraped[:2000]

        prompts = [f"{word} {i} went to the park" for i, word in enumerate("cat dog sun tree ball girl".split())]
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: one by one, all go to the first (least busy)
            assert all(response.status_code == 200 for response in pool.map(lambda p: _completion(url, p), prompts))
        served = [httpx.get(f"{r}/server_info", timeout=5).json()["stats"]["finished"] for r in replicas]
        assert min(served) > 0, served

        # A replica killed: requests go on through the other; the parent restarts it.
        victim = _replica_pid(replicas[0])
        assert victim in children
        os.kill(victim, signal.SIGKILL)
        assert all(_completion(url, f"meanwhile {p}").status_code == 200 for p in prompts)
        _wait(lambda: _replica_pid(replicas[0]) not in (None, victim), 60,
              f"replica 0 not restarted:\n{log.read_text()[-3000:]}")
        assert "replica 0 exited" in log.read_text()

        # The parent killed outright: the kernel's parent-death signal ends the rest.
        children = _children(parent.pid)
        parent.kill()
        parent.wait()
        _wait(lambda: not any(_alive(pid) for pid in children), 30,
              f"children outlived the parent: {[p for p in children if _alive(p)]}")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _embeds(url: str, texts: list[str]) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": MODEL_NAME, "input": texts}, timeout=60)


@LINUX_ONLY
def test_dp_2_serves_an_embedding_model(tmp_path: Path) -> None:
    """Embeddings through the router: both replicas embed, and alike."""
    from pooling_checkpoints import bert_embedder

    def ready(url: str) -> bool:
        try:
            return _embeds(url, ["ready"]).status_code == 200
        except httpx.HTTPError:
            return False

    parent, url, replicas, _ = _start_dp_2(bert_embedder(tmp_path, "mean"), "--router-policy", "round_robin", ready=ready)
    try:
        texts = [f"the cat {word}" for word in "sat ran is on far away".split()]
        with ThreadPoolExecutor(len(texts)) as pool:
            answers = list(pool.map(lambda t: _embeds(url, [t, "a dog"]), texts))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        dogs = [a.json()["data"][1]["embedding"] for a in answers]
        assert all(abs(x - y) < 1e-5 for dog in dogs for x, y in zip(dog, dogs[0]))  # whichever replica
        served = [httpx.get(f"{r}/server_info", timeout=5).json()["stats"]["finished"] for r in replicas]
        assert min(served) > 0, served
    finally:
        parent.kill()
        parent.wait()


@LINUX_ONLY
def test_api_key_and_sigterm(stories_path: Path) -> None:
    """With --api-key the replicas want the key, the router sends it to them
    (they register and serve) and wants it from clients; SIGTERM stops the
    router, drains the replicas and exits 0, leaving no child."""
    parent, url, replicas, log = _start_dp_2(stories_path, "--api-key", "sesame", api_key="sesame")
    try:
        assert _completion(url, "Once upon a time", "sesame").status_code == 200
        assert _completion(url, "Once upon a time").status_code == 401
        assert _completion(url, "Once upon a time", "wrong").status_code == 401
        assert httpx.get(f"{replicas[0]}/server_info", timeout=5).status_code == 401
        children = _children(parent.pid)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0, log.read_text()[-3000:]
        _wait(lambda: not any(_alive(pid) for pid in children), 10, "children outlived the parent")
        text = log.read_text()
        assert "stopping the router; the replicas drain" in text and text.count("SIGTERM: draining") == 2
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_port_in_use_is_refused_before_anything_starts(stories_path: Path) -> None:
    """A replica port another program listens on is named at once (exit 1)
    instead of the router sending requests to that program."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed: pip install -e '.[router]'")
    base = free_port_run(3)
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 1))
        squatter.listen()
        done = subprocess.run(
            [sys.executable, "-m", "aioserve", "serve", "--model", str(stories_path), "--dp", "2",
             "--port", str(port), "--dp-base-port", str(base), "--device", "cpu"],
            capture_output=True, text=True, timeout=60,
        )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"port in use on this machine: {base + 1} (replica)" in done.stderr, done.stderr[-2000:]
    assert "started (pid" not in done.stderr  # nothing was launched


def test_the_kubernetes_manifest_passes_flags_both_take() -> None:
    """deploy/kubernetes.yaml: the workers' flags parse as `aioserve serve`'s,
    the router's as sglang-router's, and the router gets --dp's failover flags."""
    yaml = pytest.importorskip("yaml")
    manifest = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes.yaml"
    documents = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    assert set(deployments) == {"aioserve-worker", "aioserve-router"}
    assert set(services) == {"aioserve-worker", "aioserve"}

    worker = deployments["aioserve-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert parse_serve_args(worker["args"]).port == 8000

    router = deployments["aioserve-router"]["spec"]["template"]["spec"]["containers"][0]
    flags = router["args"]
    names, values = ROUTER_FAILOVER_FLAGS[::2], ROUTER_FAILOVER_FLAGS[1::2]
    assert [f"{name}={value}" for name, value in zip(names, values) if f"{name}={value}" not in flags] == []
    launch = pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed")
    parsed = launch.parse_router_args([f.replace("$(POD_NAMESPACE)", "default") for f in flags])
    assert parsed.service_discovery and parsed.policy == "cache_aware"
    assert parsed.selector == {"app": "aioserve-worker"}
    assert parsed.service_discovery_port == 8000
