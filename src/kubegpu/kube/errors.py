"""The one translation of the Kubernetes client's failures into `KubeError`.

Every call through `kubegpu.kube` that fails raises `KubeError`, whatever broke: the API
server's answer (lightkube's `ApiError`, or httpx2's `HTTPStatusError` for an answer that is
not a JSON Status), the transport (httpx2: refused, reset, timed out) or the credentials
(lightkube's `ConfigError`, an unreadable kubeconfig). The message is one line:
the call and object ("patch Node gpu-1"), what went wrong, and what to do about it.

What the server says (its Status message and reason, an HTTP reason phrase, a transport
error's text, which can quote the server's bytes) is outside data: it reaches the message
only through `kubegpu.untrusted.escape`, cut to a bound, with its control characters
escaped, so a hostile or broken server cannot forge log lines or grow them without bound.

An answer that says when to try again (`Retry-After`, as an overloaded API server sends
with 429 and 503, or a Status's `details.retryAfterSeconds`) leaves that in
`KubeError.retry_after`, for the caller's backoff.
"""

from __future__ import annotations

import datetime
import email.utils
import json
from collections.abc import Mapping
from typing import Any, Final

import httpx2 as http
from lightkube import ConfigError

from kubegpu.errors import KubegpuError
from kubegpu.untrusted import escape

#: The most characters of the server's own message kept in an error: a long RBAC or
#: admission refusal (~250 characters) whole, a hostile 100 kB one cut.
MESSAGE_CHARS: Final = 400

#: What to do, by HTTP status; 404 gets the caller's own hint (what is missing differs).
_HINTS: Final[dict[int, str]] = {
    400: "; the API server refused the request as malformed",
    401: "; the credentials were refused (expired token or wrong kubeconfig user)",
    403: "; check the ServiceAccount's RBAC",
    404: "; does it exist?",
    409: "; it was changed or created concurrently: read it again and retry",
    410: "; the watch is too old: list again",
    422: "; the API server refused the object as invalid",
    429: "; the API server is throttling requests: retry later",
}


class KubeError(KubegpuError):
    """A Kubernetes API call failed; the message names the call, the object and a fix."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        #: The HTTP status the API server answered; None when it did not answer at all.
        self.status = status
        #: Seconds the API server asked the client to wait before trying again, if it did.
        self.retry_after = retry_after


def status_error(
    what: str,
    status: int,
    reason: str,
    *,
    missing: str | None = None,
    detail: str = "",
    retry_after: float | None = None,
) -> KubeError:
    """The `KubeError` for an HTTP answer: "get Node n1: HTTP 403 Forbidden; check ...".

    `missing` replaces the generic 404 hint ("; does it exist (is NFD installed)?").
    `detail` is the server's own message, kept when it says more than the status.
    `retry_after` (seconds) is the server's Retry-After, for the caller's backoff.
    """
    if status == 404 and missing is not None:
        hint = missing
    elif status >= 500:
        hint = "; the API server failed: check its health and logs"
    else:
        hint = _HINTS.get(status, "")
    said = f" ({escape(detail, MESSAGE_CHARS)})" if detail else ""
    return KubeError(
        f"{what}: HTTP {status} {escape(reason.strip())}{said}{hint}",
        status=status,
        retry_after=retry_after,
    )


def status_object_error(what: str, status: Mapping[str, Any]) -> KubeError:
    """The `KubeError` for a Status object sent in place of an answer (a watch's ERROR
    event): its code, reason and message, and its `details.retryAfterSeconds`."""
    code = status.get("code")
    reason = status.get("reason")
    return status_error(
        what,
        code if isinstance(code, int) and not isinstance(code, bool) else 500,
        reason if isinstance(reason, str) else "",
        detail=_message_of(status),
        retry_after=_retry_after_seconds(status),
    )


def translate(
    what: str, exc: BaseException, *, timeout: float | None = None, missing: str | None = None
) -> KubeError | None:
    """The `KubeError` for a failure of the call `what`, or None for a failure we do not know.

    Unknown failures (a bug, a deserialisation error) are left to propagate unchanged, so
    they are not disguised as an outage.
    """
    if (
        isinstance(exc, KeyError | ValueError)
        and isinstance(exc.__context__, http.HTTPStatusError)
        and exc.__suppress_context__ is False
    ):
        # lightkube decodes the error answer unguarded: one without a Content-Type header
        # (a proxy's 502) surfaces as KeyError raised while handling it, a Status that is
        # not one (a field of the wrong type) as msgspec's ValidationError, a ValueError.
        exc = exc.__context__
    if isinstance(exc, http.HTTPStatusError):
        answer = exc.response
        body = _body(answer)
        return status_error(
            what,
            answer.status_code,
            answer.reason_phrase,
            missing=missing,
            detail=_server_message(body),
            retry_after=retry_after_of(answer.headers.get("Retry-After"), body),
        )
    if isinstance(exc, ConfigError):
        return no_credentials(exc)
    if isinstance(exc, http.TimeoutException | TimeoutError):
        after = f" within {timeout:g}s" if timeout is not None else ""
        return KubeError(
            f"{what}: the API server did not answer{after}; check that it is up and reachable"
        )
    if isinstance(exc, http.TransportError | OSError):
        # Refused, reset, TLS failures, a proxy's refusal, an unsupported server URL.
        return unreachable(what, exc)
    return None


def unreadable(what: str, exc: BaseException) -> KubeError:
    """The `KubeError` for an answer that is not the JSON object the API sends (a broken
    server or a proxy in between): a fault of the server, retried like an outage."""
    return KubeError(
        f"{what}: the API server's answer is not a readable object ({first_line(exc)}); "
        "check the API server and any proxy between it and this node"
    )


def unreachable(what: str, exc: BaseException) -> KubeError:
    return KubeError(
        f"{what}: cannot reach the API server ({first_line(exc)}); check the network and the "
        "server address (KUBERNETES_SERVICE_HOST in a pod, `server:` in the kubeconfig)"
    )


def no_credentials(exc: BaseException) -> KubeError:
    return KubeError(
        "no Kubernetes credentials: no in-cluster config and no usable kubeconfig "
        f"({first_line(exc)}); run in a pod with a ServiceAccount or set KUBECONFIG"
    )


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text, escaped and bounded (it may quote the server)."""
    text = str(exc).strip()
    return escape(text.splitlines()[0], MESSAGE_CHARS) if text else type(exc).__name__


def _body(answer: http.Response) -> bytes:
    """The answer's body, read now for a streamed one (a refused watch); b"" when gone."""
    try:
        return answer.read()
    except (http.HTTPError, http.StreamError):
        return b""


def _server_message(body: bytes) -> str:
    """The `message` of the API server's Status object, first line only, as sent ("" if
    none): `status_error` escapes and bounds it."""
    status = _status(body)
    return _message_of(status) if status is not None else ""


def _status(body: bytes) -> dict[str, Any] | None:
    """The answer's body as a JSON object (a Status), None when it is not one."""
    if not body:
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


def _message_of(status: Mapping[str, Any]) -> str:
    message = status.get("message")
    return message.strip().splitlines()[0] if isinstance(message, str) and message.strip() else ""


def retry_after_of(header: str | None, body: bytes = b"") -> float | None:
    """Seconds to wait as the answer says: its Retry-After header (seconds, or an HTTP
    date), else its Status's `details.retryAfterSeconds`; None when it says nothing usable.

    Not bounded here: the caller's backoff caps it.
    """
    if header is not None:
        text = header.strip()
        if text.isdigit():
            return float(text)
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            when = None
        if when is not None and when.tzinfo is not None:
            return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())
    status = _status(body)
    return _retry_after_seconds(status) if status is not None else None


def _retry_after_seconds(status: Mapping[str, Any]) -> float | None:
    details = status.get("details")
    seconds = details.get("retryAfterSeconds") if isinstance(details, dict) else None
    if isinstance(seconds, int) and not isinstance(seconds, bool) and seconds >= 0:
        return float(seconds)
    return None
