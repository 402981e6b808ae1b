"""Finding the API server and proving who we are, the standard way: the in-cluster
service account, else ``KUBECONFIG`` / ``~/.kube/config``, read by the official client's
loader when the operator starts (or at first use), never at import time.

``kube.py`` makes the HTTP client from these.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are."""

    server: str
    headers: Callable[[], Mapping[str, str]]
    verify: bool
    ca_path: str | None
    cert_path: str | None
    key_path: str | None


def load_credentials() -> Credentials:
    """In-cluster service account, else ``KUBECONFIG`` / ``~/.kube/config``, read now.

    The kubeconfig path is passed explicitly because the client library freezes the
    ``KUBECONFIG`` it saw when first imported.
    """
    from kubernetes import client, config  # the loader only, imported on first use

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        path = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=cfg
        )

    def headers() -> dict[str, str]:
        # Asked per request: token files and auth plugins rotate tokens.
        token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
            "authorization"
        )
        return {"Authorization": token} if token else {}

    return Credentials(
        server=str(cfg.host),
        headers=headers,
        verify=bool(cfg.verify_ssl),
        ca_path=cfg.ssl_ca_cert or None,
        cert_path=cfg.cert_file or None,
        key_path=cfg.key_file or None,
    )
