"""A real HTTP server on 127.0.0.1 for network tests: registered routes, counted requests."""

from __future__ import annotations

import collections
import dataclasses
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass
class Route:
    body: bytes
    status: int = 200
    delay: float = 0.0  # seconds before the status line
    chunk_delay: float = 0.0  # seconds between body chunks
    chunk_size: int = 8192
    length: int | None = None  # Content-Length sent; more than the body: the transfer breaks off


class LocalServer:
    """A threaded HTTP server on 127.0.0.1 that serves registered routes and counts GETs."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.lstrip("/")
                with server._lock:
                    server.hits[path] += 1
                route = server.routes.get(path)
                if route is None:
                    self.send_error(404, "Not Found")
                    return
                if route.delay and server.stop.wait(route.delay):
                    return
                try:
                    self.send_response(route.status)
                    length = len(route.body) if route.length is None else route.length
                    self.send_header("Content-Length", str(length))
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    for start in range(0, len(route.body), route.chunk_size):
                        if route.chunk_delay and server.stop.wait(route.chunk_delay):
                            return
                        self.wfile.write(route.body[start : start + route.chunk_size])
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def serve(self, path: str, body: bytes, **options: float | int) -> str:
        self.routes[path] = Route(body, **options)
        return self.url(path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
