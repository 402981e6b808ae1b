"""What several tests and benches share: corpora, judges and helpers, never tests.

- :mod:`.crd_judge` — the generated CRD as an API server judges a spec, offline;
- :mod:`.crd_agreement` — the spec generator and the models-vs-CRD agreement run;
- :mod:`.bad_manifests` — the bad-input manifest corpus (one row per bad RefitJob);
- :mod:`.tampered_entries` — the tampered-rendezvous corpus and how each reader judges it;
- :mod:`.unpickle_scan` — the AST scan for code-executing deserialisation;
- :mod:`.processes` — process and port helpers;
- :mod:`.engine_procs` — checkpoint-engine ranks as real processes (spawn, real NIXL).

Test modules (``test_*.py``) import from here and never from each other; ``bench/`` scripts
may import from here too.  Nothing here imports a test module.
"""
