"""One image URL's bytes over HTTP(S), on a worker thread, with every bound
held: the whole fetch within its deadline (redirects included), at most a
few redirects, at most the byte cap, and only public addresses unless
private ones are allowed.

The host is resolved here and the connection made to the addresses that
were checked (not resolved again by the connection: a DNS answer that
changes between the check and the connect must not reach a private
address), on every hop. `abort()`, from another thread, ends a fetch at once by
shutting its socket: the event loop's side calls it when its own deadline
passes or the client goes away, so a server that trickles its headers
cannot hold the thread either.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from aioserve.images.addresses import is_public
from aioserve.images.errors import ImageError, shown
from aioserve.images.settings import MediaSettings

logger = logging.getLogger(__name__)

REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK = 1 << 16
USER_AGENT = "aioserve (image fetch)"


@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str  # as the server said ("" if it did not)


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to the checked addresses; the Host header names the host.
    `opened` keeps the socket: a response that closes the connection
    (HTTP/1.0, `Connection: close`) takes it over and the connection forgets
    it, yet its deadline and abort still act on it."""

    def __init__(self, host: str, port: int, addresses: list[str], timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.addresses = addresses
        self.opened: socket.socket | None = None

    def connect(self) -> None:
        self.sock = self.opened = _connect(self.addresses, self.port, self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """As _PinnedHTTP, with TLS checked against the host's name (SNI too)."""

    def __init__(self, host: str, port: int, addresses: list[str], timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.addresses = addresses
        self.tls = context
        self.opened: socket.socket | None = None

    def connect(self) -> None:
        raw = _connect(self.addresses, self.port, self.timeout)
        self.sock = self.opened = self.tls.wrap_socket(raw, server_hostname=self.host)


Pinned = _PinnedHTTP | _PinnedHTTPS


def _connect(addresses: list[str], port: int, timeout: float | None) -> socket.socket:
    """A connection to the first of the checked addresses that answers
    (localhost is ::1 and 127.0.0.1; a server may listen on one only)."""
    error: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout)
        except OSError as exc:
            error = exc
    assert error is not None
    raise error


class GuardedFetch:
    """Fetch one URL (`run`, on a worker thread); `abort` ends it from any thread."""

    def __init__(self, url: str, settings: MediaSettings) -> None:
        self.url = url
        self.settings = settings
        self.deadline = time.monotonic() + settings.fetch_timeout
        self._lock = threading.Lock()
        self._connection: Pinned | None = None
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            connection = self._connection
        if connection is not None and connection.opened is not None:
            try:
                connection.opened.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv
            except OSError:
                pass

    def run(self) -> Fetched:
        try:
            return self._follow()
        except ImageError:
            raise
        except (socket.timeout, TimeoutError):
            raise self.timeout_error() from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self._aborted or self._remaining() <= 0:
                raise self.timeout_error() from None
            raise ImageError(f"could not fetch the image at {shown(self.url)}: {exc}") from None

    # -- the hops ---------------------------------------------------------------------------

    def _follow(self) -> Fetched:
        url = self.url
        for _ in range(self.settings.max_redirects + 1):
            connection, response = self._request(url)
            try:
                if response.status in REDIRECTS:
                    location = response.getheader("Location")
                    if not location:
                        raise ImageError(f"the image URL {shown(url)} redirected (HTTP {response.status}) nowhere")
                    url = urljoin(url, location)
                    continue
                if response.status != 200:
                    raise ImageError(f"the image URL {shown(url)} answered HTTP {response.status} {response.reason}")
                return Fetched(self._body(connection, response), response.getheader("Content-Type") or "")
            finally:
                response.close()
                connection.close()
                with self._lock:
                    self._connection = None
        raise ImageError(f"the image URL {shown(self.url)} redirected more than {self.settings.max_redirects} times")

    def _request(self, url: str) -> tuple[Pinned, http.client.HTTPResponse]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageError(f"an image URL must be http(s), a data URL or a file: {shown(url)}")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        addresses = self._addresses(parts.hostname, port)
        timeout = self._remaining_or_fail()
        connection: Pinned
        if https:
            connection = _PinnedHTTPS(parts.hostname, port, addresses, timeout, ssl.create_default_context())
        else:
            connection = _PinnedHTTP(parts.hostname, port, addresses, timeout)
        with self._lock:
            if self._aborted:
                raise self.timeout_error()
            self._connection = connection
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", target, headers={
            "User-Agent": USER_AGENT, "Accept": "image/*", "Accept-Encoding": "identity",
        })
        return connection, connection.getresponse()

    def _addresses(self, host: str, port: int) -> list[str]:
        """The addresses to connect to, the host's: every one must be public
        (unless private ones are allowed)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ImageError(f"the image URL's host {host!r} does not resolve: {exc.strerror}") from None
        addresses = [str(info[4][0]) for info in infos]
        if not self.settings.allow_private_urls:
            for text in addresses:
                if not is_public(ipaddress.ip_address(text.split("%")[0])):
                    # Worth an operator's eye: a request tried to reach the server's own network.
                    logger.info("refused an image URL whose host %r is %s (not a public address)", host, text)
                    raise ImageError(
                        f"the image URL's host {host!r} is {text}, a private, loopback or link-local address: "
                        "this server does not fetch from its own network"
                    )
        return list(dict.fromkeys(addresses))  # getaddrinfo repeats an address per protocol

    def _body(self, connection: Pinned, response: http.client.HTTPResponse) -> bytes:
        cap = self.settings.max_image_bytes
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise ImageError(f"the image at {shown(self.url)} is {int(declared)} bytes, more than the limit of {cap}")
        chunks: list[bytes] = []
        total = 0
        while True:
            remaining = self._remaining_or_fail()
            if connection.opened is not None:
                connection.opened.settimeout(remaining)
            chunk = response.read1(CHUNK)  # one receive at most: the deadline is looked at between them
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > cap:
                raise ImageError(f"the image at {shown(self.url)} is more than the limit of {cap} bytes")
            chunks.append(chunk)

    # -- the deadline -----------------------------------------------------------------------

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _remaining_or_fail(self) -> float:
        remaining = self._remaining()
        if remaining <= 0 or self._aborted:
            raise self.timeout_error()
        return remaining

    def timeout_error(self) -> ImageError:
        return ImageError(
            f"fetching the image at {shown(self.url)} took longer than {self.settings.fetch_timeout:g} s "
            "(--media-fetch-timeout)"
        )
