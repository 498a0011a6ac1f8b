"""`outbox secret new`: a secret the signing code takes, fresh at every call."""

from __future__ import annotations

import base64

import pytest
import standardwebhooks

from outbox.signing import parse_secret, sign, verify
from outbox_cli import main


def _new_secret(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["secret", "new"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert out.endswith("\n"), out
    return out.strip()


def test_a_new_secret_signs_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    secret = _new_secret(capsys)
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == 32
    headers = sign(secret, "order-1:created", None, b'{"order_id":1}')
    assert verify([parse_secret(secret)], headers, b'{"order_id":1}') == "order-1:created"
    # The reference implementation reads it the same way.
    standardwebhooks.Webhook(secret).verify(b'{"order_id":1}', headers)


def test_two_calls_make_two_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    assert _new_secret(capsys) != _new_secret(capsys)
