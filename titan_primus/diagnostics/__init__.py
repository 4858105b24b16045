"""The library that computes every result the tools report, as data the CLI renders: the
environment (versions, device profiles, why a backend cannot run an op, the routing table:
``environment``), the results file format (``results``) and memory (``memory``: what converted
layers keep for backward, measured; the per-model model; the audit ``bench --memory`` reports).
Never imports the CLI (tests/unit/test_imports.py)."""
