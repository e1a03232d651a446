"""A real HTTP file server on 127.0.0.1 with switchable faults, for download tests.

    with FaultyHTTPServer() as server:
        server.add_file("archive.tar.gz", payload)
        server.fail_next(500, times=2)           # the next two requests get HTTP 500
        server.drop_next(after_bytes=1000)       # then one sends 1,000 body bytes and closes
        server.stall_next(after_bytes=1000, seconds=1.0)  # or sends 1,000 bytes, then goes silent
        server.ignore_range = True               # answer every request with the full body (200)
        fetch(server.url("archive.tar.gz"))
        server.requests                          # what the server received, in order

Faults apply to requests in the order they were queued, one fault per request; requests after the
queue is empty are served normally (with `Range: bytes=N-` support unless `ignore_range` is set).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

HOST = "127.0.0.1"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _QuietThreadingHTTPServer(ThreadingHTTPServer):
    """Daemon handler threads, and no tracebacks when a client hangs up mid-response (tests do that)."""

    daemon_threads = True
    block_on_close = False  # Stalled handlers must not hold up shutdown.

    def handle_error(self, request: object, client_address: object) -> None:
        """Ignores errors from clients that gave up on a stalled or dropped response."""


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it."""

    path: str
    range: str | None  # The Range header, if the client sent one.


@dataclass(frozen=True)
class Fault:
    """What the server does to one request instead of serving it normally."""

    # "status": answer `status`; "drop": send `after_bytes` of the body, then close; "stall": send them,
    # then wait `seconds`; "misrange": a 206 with the whole body, labelled as starting at byte 0.
    kind: str
    status: int = 500
    after_bytes: int = 0
    seconds: float = 0.0
    headers: tuple[tuple[str, str], ...] = ()


class FaultyHTTPServer:
    """A ThreadingHTTPServer on a free 127.0.0.1 port, serving in-memory files with injected faults."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.ignore_range = False
        self._faults: deque[Fault] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._server = _QuietThreadingHTTPServer((HOST, 0), _handler_class(self))
        # A short poll interval makes shutdown (and so every test using the server) quick.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="faulty-http", daemon=True
        )

    def __enter__(self) -> FaultyHTTPServer:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def url(self, name: str) -> str:
        """The URL of a served file."""
        return f"http://{HOST}:{self.port}/{name}"

    def add_file(self, name: str, data: bytes) -> None:
        """Serves `data` at `/name`."""
        self.files[name] = data

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in order."""
        with self._lock:
            return list(self._requests)

    def fail_next(self, status: int, times: int = 1, headers: dict[str, str] | None = None) -> None:
        """The next `times` requests get an error `status` (with optional extra headers)."""
        self._queue(Fault("status", status=status, headers=tuple((headers or {}).items())), times)

    def drop_next(self, after_bytes: int, times: int = 1) -> None:
        """The next `times` requests announce the full length, send `after_bytes` of the body, then close."""
        self._queue(Fault("drop", after_bytes=after_bytes), times)

    def stall_next(self, after_bytes: int, seconds: float) -> None:
        """The next request sends `after_bytes` of the body, then goes silent for `seconds`."""
        self._queue(Fault("stall", after_bytes=after_bytes, seconds=seconds), 1)

    def misrange_next(self) -> None:
        """The next request gets a 206 whose Content-Range starts at 0, whatever Range it asked for."""
        self._queue(Fault("misrange"), 1)

    def _queue(self, fault: Fault, times: int) -> None:
        with self._lock:
            self._faults.extend([fault] * times)

    def _record(self, request: RecordedRequest) -> Fault | None:
        """Logs a request and returns the fault it gets, if any."""
        with self._lock:
            self._requests.append(request)
            return self._faults.popleft() if self._faults else None


def _handler_class(server: FaultyHTTPServer) -> type[BaseHTTPRequestHandler]:
    """A request handler bound to `server`'s files, faults and request log."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            range_header = self.headers.get("Range")
            fault = server._record(RecordedRequest(self.path, range_header))
            name = self.path.lstrip("/")
            if fault is not None and fault.kind == "status":
                self._send_status(fault.status, dict(fault.headers))
                return
            if name not in server.files:
                self._send_status(404)
                return
            data = server.files[name]
            start = self._range_start(range_header, len(data))
            if start is None:
                return
            body = data[start:]
            if fault is not None and fault.kind == "misrange":
                self._send_headers(0, len(data), partial=True)
                self.wfile.write(data)
                return
            if fault is not None:
                self._send_partial(body, start, len(data), fault)
                return
            self._send_headers(start, len(data))
            self.wfile.write(body)

        def _range_start(self, range_header: str | None, size: int) -> int | None:
            """The first byte to send; None when a 416 was sent instead."""
            if server.ignore_range or not range_header:
                return 0
            match = _RANGE.fullmatch(range_header.strip())
            if match is None:
                return 0
            start = int(match.group(1))
            if start >= size:
                self._send_status(416, {"Content-Range": f"bytes */{size}"})
                return None
            return start

        def _send_headers(self, start: int, size: int, partial: bool = False) -> None:
            """A 206 with Content-Range when serving from `start` > 0 (or when `partial`), else a 200."""
            if start or partial:
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size - start))
            self.send_header("Accept-Ranges", "none" if server.ignore_range else "bytes")
            self.end_headers()

        def _send_partial(self, body: bytes, start: int, size: int, fault: Fault) -> None:
            """Announces the whole body but sends only part of it (then stalls or closes)."""
            self._send_headers(start, size)
            self.wfile.write(body[: fault.after_bytes])
            self.wfile.flush()
            if fault.kind == "stall":
                time.sleep(fault.seconds)
            self.close_connection = True

        def _send_status(self, status: int, headers: dict[str, str] | None = None) -> None:
            message = f"status {status}\n".encode()
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(message)))
            self.end_headers()
            self.wfile.write(message)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: tests read `server.requests` instead."""

    return Handler
