"""The router's side of the LoRA ``vllm serve`` example: it follows the adapter versions
the server registers and asks each by name.

It polls ``/v1/models`` on ``--url``.  Each time a new adapter version (``<name>-v<k>``)
appears it sends the first fixed prompt to ``/v1/completions`` with ``"model"`` naming that
version (greedy, prompt token ids), and once more naming each version it saw before that
the server no longer lists.  Every answer is one JSON line on stdout:
``{"asked": version, "status": 200, "tokens": [...]}`` or ``{"asked": version, "status":
404, "error": "..."}``.  Stops after ``--max-seconds`` or when the server stops answering.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl-vllm"))

import tiny_llama


def call(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """GET (no body) or POST JSON; the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def ask(url: str, version: str) -> None:
    status, answer = call(
        url + "/v1/completions",
        {
            "model": version,
            "prompt": list(tiny_llama.PROMPTS[0]),
            "max_tokens": tiny_llama.NEW_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    line: dict[str, Any] = {"asked": version, "status": status}
    if status == 200:
        line["tokens"] = answer["choices"][0].get("token_ids")
        line["model"] = answer.get("model")
    else:
        line["error"] = json.dumps(answer)[:300]
    print(json.dumps(line), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args()
    deadline, seen, answered = time.monotonic() + args.max_seconds, [], False
    while time.monotonic() < deadline:
        try:
            _, models = call(args.url + "/v1/models")
        except (urllib.error.URLError, OSError):
            if answered:
                return 0  # the server stopped
            time.sleep(1)
            continue
        answered = True
        listed = [m["id"] for m in models["data"] if m.get("parent")]  # adapters only
        for version in (v for v in listed if v not in seen):
            seen.append(version)
            ask(args.url, version)
            for old in (v for v in seen if v not in listed):
                ask(args.url, old)
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
