"""The process that parses large request bodies, so that the event loop never
holds the GIL through seconds of json.loads (a C call no thread can break
into): run as a plain script (`python worker.py`), standard library
only, it reads frames from stdin and answers each on stdout.

A frame is an 8-byte big-endian length and a pickle: (body bytes, the
RequestLimits as a dict, the model's known field names). The answer:
("ok", data, unknown field names) or ("rejected", message, param, code).
It ends when stdin closes (the server exited)."""

from __future__ import annotations

import pickle
import signal
import struct
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the checker reads the package's module; the script runs beside it
    from aioserve.server.body.checks import BodyRejected, RequestLimits, decode
else:
    from checks import BodyRejected, RequestLimits, decode  # this script's own folder is on sys.path

FRAME_HEADER = struct.Struct("!Q")


def answer(frame: bytes) -> tuple:
    raw, limits, known = pickle.loads(frame)
    try:
        data, unknown = decode(raw, RequestLimits(**limits), frozenset(known))
    except BodyRejected as exc:
        return ("rejected", exc.message, exc.param, exc.code)
    except MemoryError:
        return ("rejected", "the request body is too large to parse", None, "request_too_large")
    return ("ok", data, unknown)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which closes our stdin
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(FRAME_HEADER.size):
        (size,) = FRAME_HEADER.unpack(header)
        reply = pickle.dumps(answer(stdin.read(size)), protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(FRAME_HEADER.pack(len(reply)))
        stdout.write(reply)
        stdout.flush()


if __name__ == "__main__":
    main()
