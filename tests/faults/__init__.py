"""Proof under faults: real processes killed at failpoints, database and network faults."""
