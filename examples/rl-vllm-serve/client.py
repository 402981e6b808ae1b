"""The RL framework's side of the ``vllm serve`` example: a client of the rollout server.

``--write-checkpoint DIR`` writes the trainer's initial checkpoint (the same seed as the
policy's, so both sides start equal) and exits.  Otherwise it waits for the server at
``--url`` and sends the fixed prompts (which share a 72-token prefix, as RL prompts
share a system prompt) to ``/inference/v1/generate`` one after another, greedy, for as
long as the server answers.  Every response is one JSON line on stdout:
``{"response": {"prompt": i, "tokens": [...], "logprobs": [...], "versions": [...],
"sent_at": t0, "answered_at": t1}}``: the tokens, their logprobs and the weight
version(s) the server says produced them, so a reader can check each against HF on that
version's weights (the trainer prints its reference for every refit).

Stops once the job's last refit (its ``REFIT_*`` environment says which) has answered
``--after-last`` requests, when the server stops answering, on SIGTERM, or after
``--max-seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl-vllm"))

import tiny_llama


def generate(url: str, prompt: list[int], timeout_s: float) -> dict:
    body = {
        "token_ids": prompt,
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": tiny_llama.NEW_TOKENS,
            "min_tokens": tiny_llama.NEW_TOKENS,
            "ignore_eos": True,
            "logprobs": 0,  # the sampled token's own logprob
        },
    }
    request = urllib.request.Request(
        url + "/inference/v1/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def last_refit() -> str | None:
    """``refit-<k>@``, the label prefix of the job's last refit; None outside a job."""
    if "REFIT_JOB" not in os.environ:
        return None
    from refit_worker.contract.config import WorkerConfig

    return f"refit-{WorkerConfig.from_env().transfer.refits - 1}@"


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-checkpoint", type=Path, help="write the initial model, exit")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the rollout server")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="give up after")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="per request")
    parser.add_argument(
        "--after-last", type=int, default=8, help="responses from the last refit, then stop"
    )
    args = parser.parse_args()
    if args.write_checkpoint is not None:
        tiny_llama.save_checkpoint(tiny_llama.build_model(seed=0), args.write_checkpoint)
        return 0
    last = last_refit()
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(now=True))
    deadline = time.monotonic() + args.max_seconds
    while not answers(args.url):
        if stop["now"] or time.monotonic() > deadline:
            print(json.dumps({"client": "the server never answered"}), flush=True)
            return 1
        time.sleep(0.5)
    sent = from_last = 0
    while not stop["now"] and time.monotonic() < deadline:
        index = sent % len(tiny_llama.PROMPTS)
        sent_at = time.time()
        try:
            answer = generate(args.url, list(tiny_llama.PROMPTS[index]), args.request_timeout)
        except (urllib.error.URLError, OSError, ConnectionError):
            break  # the server is gone: the rollout finished (or was stopped)
        choice = answer["choices"][0]
        record = {
            "prompt": index,
            "tokens": choice["token_ids"],
            "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
            "versions": choice["weight_versions"],
            "sent_at": sent_at,
            "answered_at": time.time(),
        }
        print(json.dumps({"response": record}), flush=True)
        sent += 1
        if last is not None and any(v["version"].startswith(last) for v in record["versions"]):
            from_last += 1
            if from_last >= args.after_last:
                break
    print(json.dumps({"client": f"{sent} responses"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
