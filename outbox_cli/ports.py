"""Ports the long-running commands listen on, bound before anything says "listening"."""

from __future__ import annotations

import argparse
import socket
from typing import Any

from outbox.observability.server import MetricsServer
from outbox_cli import processes
from outbox_cli.failures import port_unavailable


def listening_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket listening on host:port; PortUnavailable names the port and `flag` when not."""
    try:
        return processes.bind(host, port)
    except OSError as exc:
        raise port_unavailable(exc, host, port, flag) from None


def metrics_server(args: argparse.Namespace, **answers: Any) -> MetricsServer:
    """The --metrics-port server, bound (not yet serving); PortUnavailable when it cannot be."""
    try:
        return MetricsServer(args.metrics_port, host=args.metrics_host, **answers)
    except OSError as exc:
        raise port_unavailable(
            exc, args.metrics_host, args.metrics_port, "--metrics-port"
        ) from None
