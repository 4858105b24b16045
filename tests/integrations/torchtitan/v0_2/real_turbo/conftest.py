"""The TorchTitan 0.2.x adapter on Primus-Turbo's own code (``make test-tt02`` runs it per
architecture for the build AMD's rocm/primus v26.5 image pairs with TorchTitan 0.2.2). The
harness, and its rules with ``CI`` set, are the main suite's: tests/real_turbo/loader.py."""

from real_turbo import loader

loader.require_sources_on_ci()
pytest_report_header = loader.report_header
pytest_collection_modifyitems = loader.skip_without_sources
pytest_runtest_logreport = loader.count_executed
pytest_sessionfinish = loader.fail_when_nothing_ran
