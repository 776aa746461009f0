"""What tests/docker needs from the machine: a Docker engine (started here
when there is none and we may), a local base image to build on when image
registries are out of reach, and the files that make a build work offline-ish
(the host's CA certificates, the torch wheel already on disk).

Each helper answers None or raises `Unavailable` with a reason the test
shows as its skip reason."""

from __future__ import annotations

import configparser
import glob
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Built once with debootstrap and kept in the engine's image store: reruns reuse it.
LOCAL_BASE = "aioserve-test-base:{codename}"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")


class Unavailable(Exception):
    """Docker cannot be used here (the test skips with this reason)."""


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@dataclass
class DockerClient:
    binary: str
    buildkit: bool

    def __call__(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, DOCKER_BUILDKIT="1" if self.buildkit else "0")
        return run([self.binary, *args], timeout, env, check)

    def engine_up(self) -> bool:
        try:
            return self("info", "--format", "{{.ServerVersion}}", timeout=20, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def find_client() -> DockerClient:
    # Debian's docker.io client has BuildKit built in; a newer client without
    # the buildx plugin can only use the classic builder.
    candidates = [b for b in ("/usr/bin/docker", shutil.which("docker")) if b and os.access(b, os.X_OK)]
    if not candidates:
        raise Unavailable("no docker client installed (apt-get install docker.io)")
    binary = candidates[0]
    buildx = run([binary, "buildx", "version"], 20, check=False).returncode == 0
    version = run([binary, "version", "--format", "{{.Client.Version}}"], 20, check=False).stdout
    major = int(m.group(1)) if (m := re.match(r"(\d+)\.", version.strip())) else 0
    return DockerClient(binary, buildkit=buildx or 18 < major < 23)


class Dockerd:
    """A dockerd started by the tests, stopped (with the containerd it
    started) by `stop`. Images stay in its data root for the next run."""

    def __init__(self, client: DockerClient, log: Path) -> None:
        self.client = client
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        binary = shutil.which("dockerd")
        if binary is None:
            raise Unavailable("no Docker engine running and no dockerd binary to start one")
        if os.geteuid() != 0:
            raise Unavailable("no Docker engine running, and starting dockerd needs root")
        # No iptables (none in these sandboxes; -p still works through docker-proxy).
        # overlay2 starts containers in ~0.4 s; vfs (copies every layer) works everywhere.
        for driver in ("overlay2", "vfs"):
            self.process = subprocess.Popen(
                [binary, "--iptables=false", f"--storage-driver={driver}"],
                stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                if self.client.engine_up():
                    logger.info("started dockerd (pid %d, %s)", self.process.pid, driver)
                    return
                time.sleep(0.5)
            self.stop()
        raise Unavailable(f"dockerd did not start; see {self.log}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def apt_mirror() -> str:
    """The Debian mirror apt uses here (deb822 .sources or one-line lists)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for uri in re.findall(r"^URIs:\s*(\S+)", Path(path).read_text(), re.M):
            if "security" not in uri:
                return uri
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        if os.path.exists(path):
            for uri in re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)", Path(path).read_text(), re.M):
                if "security" not in uri:
                    return uri
    return "http://deb.debian.org/debian"


def host_codename() -> str:
    text = Path("/etc/os-release").read_text() if os.path.exists("/etc/os-release") else ""
    match = re.search(r"^VERSION_CODENAME=(\w+)", text, re.M)
    if not match or "ID=debian" not in text:
        raise Unavailable("building a local base image needs a Debian host (debootstrap of its release)")
    return match.group(1)


def ensure_local_base(client: DockerClient) -> str:
    """A minimal Debian image of the host's release: pulled images are out of
    reach here, so debootstrap one (~2 min, once) and `docker import` it."""
    name = LOCAL_BASE.format(codename=host_codename())
    if client("image", "inspect", name, check=False).returncode == 0:
        return name
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise Unavailable(f"no {name} image, and building it needs root and debootstrap (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="aioserve-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        run(["debootstrap", "--variant=minbase", host_codename(), str(root), apt_mirror()], timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([client.binary, "import", "-", name], stdin=tar.stdout, capture_output=True, timeout=300)
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.decode()[-2000:]}")
    return name


def find_links() -> list[Path]:
    """pip's find-links folders (environment and pip config)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    parser = configparser.ConfigParser()
    parser.read(["/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.expanduser("~/.config/pip/pip.conf"),
                 os.path.expanduser("~/.pip/pip.conf")])
    for section in ("global", "install"):
        if parser.has_option(section, "find-links"):
            values += parser.get(section, "find-links").split()
    return [Path(v.removeprefix("file://")) for v in values if not v.startswith(("http:", "https:"))]


def torch_wheel(version: str) -> Path | None:
    """The wheel of the torch this venv runs, if it lies on disk."""
    for folder in find_links():
        for wheel in sorted(folder.glob(f"torch-{version}-*.whl")):
            return wheel
    return None


def place(source: Path, folder: Path) -> None:
    """Hard-link (a 200 MB wheel costs nothing), or copy across file systems."""
    target = folder / source.name
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def host_ca_certificates() -> list[Path]:
    """Certificates this machine added to its trust store (e.g. a TLS-inspecting
    proxy's): builds on it reach PyPI only with them."""
    return sorted(HOST_CA_DIR.glob("*.crt")) if HOST_CA_DIR.is_dir() else []
