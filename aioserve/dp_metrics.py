"""`--dp N`: the replicas' Prometheus metrics merged at one address.

The router in front of the replicas passes the OpenAI and SGLang routes, not
`/metrics`, and the replicas listen on loopback ports a scraper elsewhere
cannot reach. The supervisor therefore serves `/metrics` itself, on
--dp-metrics-port of --host: at each scrape it reads every replica's
`/metrics` and returns them as one exposition, each sample labelled with its
replica (`replica="0"`), each metric family once (Prometheus' text format
wants a family's samples together under one HELP/TYPE), and
`aioserve:dp_replica_up{replica="i"}` saying which replicas answered.
"""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
UP = "aioserve:dp_replica_up"


def labelled(sample: str, replica: int) -> str:
    """A sample line with `replica="i"` as its first label."""
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1 :]
        return f'{sample[:brace]}{{replica="{replica}"{"" if rest.startswith("}") else ","}{rest}'
    return f'{sample[:space]}{{replica="{replica}"}}{sample[space:]}'


def merged(texts: list[str | None]) -> str:
    """One exposition of the replicas' (None: the replica did not answer)."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP/TYPE lines, samples)
    for replica, text in enumerate(texts):
        family = ""
        for line in (text or "").splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                meta, _ = families.setdefault(family, ([], []))
                if line not in meta:
                    meta.append(line)
            elif line and not line.startswith("#"):
                families.setdefault(family, ([], []))[1].append(labelled(line, replica))
    out = [f"# HELP {UP} Whether the replica answered this scrape.", f"# TYPE {UP} gauge"]
    out += [f'{UP}{{replica="{i}"}} {0 if text is None else 1}' for i, text in enumerate(texts)]
    for meta, samples in families.values():
        out += meta + samples
    return "\n".join(out) + "\n"


def scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError):
        return None


class MergedMetrics:
    """A small HTTP server (a thread of the supervisor) answering GET /metrics."""

    def __init__(self, replica_urls: list[str], host: str, port: int) -> None:
        urls = list(replica_urls)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = merged([scrape(url) for url in urls]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{port}/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, name="dp-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
