"""Standard Webhooks requests: signed headers, and one POST bounded by the attempt's timeout.

Every attempt sends the stored body bytes unchanged with the same reply_id.
Errors kept for operators never include headers or secrets.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from outbox.signing import sign
from outbox.tracing import annotate
from relay.destination import Destination
from relay.errors import TransportError
from relay.http_client import HttpClient, Response
from relay.policy import Retry, truncate

USER_AGENT = "outbox-relay/0.1"
FIXED_HEADERS: Mapping[str, str] = MappingProxyType(
    {"content-type": "application/json", "user-agent": USER_AGENT}
)
"""What every delivery says besides its signature."""


def request_headers(
    destination: Destination, msg_id: str, body: bytes, timestamp: float | None = None
) -> dict[str, str]:
    """Content type, user agent, and the Standard Webhooks signature of `body` as `msg_id`
    (signed at `timestamp`, by default now)."""
    headers = dict(FIXED_HEADERS)
    key = destination.signing_key
    if key is not None:
        headers.update(sign(key, msg_id, timestamp, body))
    else:
        headers["webhook-id"] = msg_id
    return headers


async def post(
    client: HttpClient, destination: Destination, url: str, headers: Mapping[str, str], body: bytes
) -> Response | Retry:
    """The whole answer to one POST, or the Retry that a timeout or transport error means."""
    try:
        response = await client.request(
            "POST", url, headers=headers, body=body, seconds=destination.timeout
        )
    except TimeoutError:
        return Retry(None, f"attempt exceeded {destination.timeout:g}s")
    except TransportError as exc:
        return Retry(None, truncate(str(exc)))
    annotate({"http.response.status_code": response.status})
    return response


def snippet(response: Response) -> str:
    """The start of a refusal's body, kept with the error; nothing of a 2xx."""
    if 200 <= response.status < 300:
        return ""
    return truncate(response.text(), 200)
