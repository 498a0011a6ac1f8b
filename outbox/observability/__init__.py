"""What every long-running process shows about itself: health, readiness and metrics.

The relay, the receiver and the worker share these pieces: a database read that
answers within a deadline (`probe`), a gauge of whether the database answered
(`database`), and a small threaded HTTP server for /metrics, /healthz and
/readyz (`server`). Each process keeps its own metrics in a registry of its own.
"""
