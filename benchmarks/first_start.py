"""The README's first command from an empty kernel cache: how long until
/health says 200 (the native kernels' build included), and how long the
first 64-token completion on the demo model then takes (goal: under 0.5 s,
i.e. full speed from the first request).

    python benchmarks/first_start.py [--keep-cache] [-- extra `aioserve serve` flags]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from server_process import free_port, process_gone, wait_for_health  # noqa: E402

BODY = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep-cache", action="store_true", help="use the usual kernel cache, not an empty one")
    parser.add_argument("serve_args", nargs="*", help="extra `aioserve serve` flags (after --)")
    args = parser.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="aioserve-first-start-") as cache:
        if not args.keep_cache:
            env["AIOSERVE_NATIVE_CACHE"] = cache
        port = free_port()
        log = Path(cache) / "server.log"
        started = time.monotonic()
        with open(log, "w") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "aioserve", "serve", "--port", str(port), *args.serve_args],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        try:
            why = wait_for_health(url, process_gone(server, log.read_text), timeout=3600, interval=0.1)
            if why is not None:
                sys.exit(why)
            ready = time.monotonic() - started
            times = []
            for _ in range(3):
                begin = time.monotonic()
                response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
                times.append(time.monotonic() - begin)
                assert response.json()["usage"]["completion_tokens"] == 64, response.text
            console = [line for line in log.read_text().splitlines() if line.startswith("aioserve:")]
        finally:
            server.terminate()
            server.wait(timeout=60)
    print("\n".join(console))
    print(f"/health 200 after {ready:.1f} s (kernel cache: {'kept' if args.keep_cache else 'empty'})")
    print("64-token completions: " + ", ".join(f"{t:.3f} s" for t in times) + " (the first one first)")


if __name__ == "__main__":
    main()
