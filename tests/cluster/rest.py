"""A small synchronous JSON client for the real apiserver, used by the process nodes and
the tests themselves (plain dicts, explicit paths, the server's status code on error).

Must not import: the operator, the worker, kubernetes (stdlib only).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    """The apiserver answered an error; :attr:`status` is its HTTP code."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        try:
            message = str(json.loads(body).get("message", body))
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{method} {path} -> HTTP {status}: {message}")
        self.status = status
        self.message = message


class Rest:
    """Requests to ``server`` with a bearer ``token``, trusting ``ca_file``."""

    def __init__(self, server: str, token: str, ca_file: Path, timeout_s: float = 30.0) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self._context = ssl.create_default_context(cafile=str(ca_file))
        self._timeout = timeout_s

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        url = self.server + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(
                request, timeout=self._timeout, context=self._context
            ) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, method, path, exc.read().decode(errors="replace")) from None
        return json.loads(text) if text else None

    def get(self, path: str, **params: str) -> Any:
        return self.request("GET", path, params=params or None)

    def find(self, path: str) -> Any:
        """The object, or None on 404."""
        try:
            return self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any, content_type: str = MERGE) -> Any:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)


def pod_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/pods"
    return f"{base}/{name}" if name else base
