"""The operator on a cluster: kopf's handlers, the controller that reads a job and applies
the core's decision, the one module that talks to the Kubernetes API (``kube``) and the
writes made through it, credentials, leader election (``lease`` decides, ``leader`` calls),
the Event recorder, the HTTP endpoints and the Prometheus metrics, the operator process
(``runtime``) and its settings.

The only layer that imports kopf, kubernetes or aiohttp; nothing below imports it.
"""
