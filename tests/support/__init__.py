"""Helpers shared by the test suites (importable thanks to pytest's pythonpath)."""
