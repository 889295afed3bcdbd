"""Helpers the tests import (`from support.engine import ...`); no tests here, and none may be: pytest
collects only tests/*/test_*.py. Importable under plain pytest from the repository root and under Bazel
(toolchains/bazel/dgr_launcher.py runs the real test file, so tests/ is on sys.path either way)."""
