"""A loopback HTTP server answering vLLM 0.32's two dynamic LoRA endpoints as it does:
200 with a plain-text line, or 404 with a JSON error for unloading a name it does not
hold.  It stands in for ``vllm serve`` where the test is about refit-vllm-serve's calls,
not vLLM (the engines-tier and manual runs use the real server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: (path, JSON body) of every POST, in order.
Seen = list[tuple[str, dict[str, Any]]]


@contextmanager
def lora_server() -> Iterator[tuple[str, Seen]]:
    """The server's base URL and the POSTs it received."""
    seen: Seen = []
    held: set[str] = set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            name = body["lora_name"]
            if self.path == "/v1/unload_lora_adapter" and name not in held:
                self.send_response(404)
                self.end_headers()
                self.wfile.write(json.dumps({"message": f"adapter '{name}' not found"}).encode())
                return
            (held.add if self.path == "/v1/load_lora_adapter" else held.discard)(name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"Success: LoRA adapter '{name}' done.".encode())  # plain text

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        thread.join(5)
