"""A webhook receiver on 127.0.0.1 (or a given host): records every POSTed JSON body, answers 200.

with WebhookReceiver() as receiver:              # .url: http://127.0.0.1:PORT/hook
    ...                                          # point CIFAR_NOTIFY_WEBHOOK_URL at receiver.url
    receiver.wait_for("waits for your approval", timeout=60)
    receiver.texts()                             # the Slack-style `text` of every message, in order
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness.ports import HOST


class WebhookReceiver:
    def __init__(self, host: str = HOST, port: int = 0) -> None:
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name.
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"raw": raw.decode("utf-8", "replace")}
                with receiver._lock:
                    receiver.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def texts(self) -> list[str]:
        with self._lock:
            return [str(body.get("text", body)) for body in self.bodies]

    def matching(self, fragment: str) -> list[str]:
        return [text for text in self.texts() if fragment in text]

    def wait_for(self, fragment: str, timeout: float, count: int = 1) -> list[str]:
        """The messages containing `fragment`, once there are `count` (TimeoutError with all received)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.matching(fragment)
            if len(found) >= count:
                return found
            time.sleep(0.5)
        raise TimeoutError(f"{count} message(s) with {fragment!r} not received in {timeout:.0f} s: {self.texts()}")
