"""An HTTP server on 127.0.0.1 (in-process, a thread) that serves a PNG and misbehaves on
purpose: redirects, an oversized body, an answer that waits until the test releases it."""
from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.multimodal.conftest import make_image

PNG_IMAGE = make_image(42, 56, 21)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """The fetcher hangs up mid-body on purpose (byte cap, deadline): no traceback."""


class ImageHost:
    """`url(path)` on a free port; `hits` counts the requests that reached it; `/slow`
    answers once `release` is set (and sets `slow_started` when it is reached)."""

    def __init__(self, oversized_bytes: int = 1 << 20) -> None:
        self.png = png_bytes(PNG_IMAGE)
        self.oversized_bytes = oversized_bytes
        self.hits: list[str] = []
        self.slow_started, self.release = threading.Event(), threading.Event()
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> ImageHost:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def _handler(self):
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:   # keep the test output quiet
                pass

            def do_GET(self) -> None:
                host.hits.append(self.path)
                route = {"/image.png": self._image, "/redirect-here": self._redirect_here,
                         "/redirect-away": self._redirect_away, "/huge": self._huge,
                         "/huge-declared": self._huge_declared,
                         "/slow": self._slow}.get(self.path)
                if route is None:
                    self.send_error(404)
                else:
                    route()

            def _image(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(host.png)))
                self.end_headers()
                self.wfile.write(host.png)

            def _redirect_here(self) -> None:
                self._redirect("/image.png")

            def _redirect_away(self) -> None:
                self._redirect(host.url("/image.png", host="localhost"))

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _huge(self) -> None:
                """A PNG's first bytes, then more than the limit, no length stated."""
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                self.wfile.write(host.png[:64])
                chunk = bytes(64 << 10)
                for _ in range(host.oversized_bytes // len(chunk) + 1):
                    try:
                        self.wfile.write(chunk)
                    except OSError:   # the client stopped reading, as it should
                        return

            def _huge_declared(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(host.oversized_bytes + 1))
                self.end_headers()

            def _slow(self) -> None:
                host.slow_started.set()
                host.release.wait(timeout=10)
                self._image()

        return Handler
