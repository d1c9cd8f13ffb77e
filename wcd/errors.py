"""Errors with stable wire codes.

Every failure a peer can see is a `WcdError` subclass whose `code` is part of the protocol.
The classes know nothing about sockets: the server turns them into error replies and the
client turns error replies back into them (`from_wire`).
"""

from __future__ import annotations

from typing import Any, ClassVar


class WcdError(Exception):
    """Base class: `code` is the stable wire code, `details` a small JSON-able dict."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class Internal(WcdError):
    code = "internal"


class BadRequest(WcdError):
    code = "bad_request"


class ProtocolError(WcdError):
    """The byte stream itself is malformed: the connection cannot continue."""

    code = "protocol_error"


class UnsupportedVersion(WcdError):
    code = "unsupported_version"


class NotFound(WcdError):
    code = "not_found"


class KeyMismatch(WcdError):
    """An entry exists for the model but not for this exact key; details["fields"] names the differences."""

    code = "key_mismatch"


class Busy(WcdError):
    code = "busy"


class OutOfMemory(WcdError):
    code = "out_of_memory"


class PermissionDenied(WcdError):
    code = "permission_denied"


class LeaseExpired(WcdError):
    code = "lease_expired"


class LoadFailed(WcdError):
    code = "load_failed"


class DeviceUnavailable(WcdError):
    """The device exists in the config or request, but this machine cannot serve it: the CUDA
    backend is not installed, or there is no usable NVIDIA driver. The message says what to install."""

    code = "device_unavailable"


class DaemonUnavailable(WcdError):
    """Client side only: the daemon cannot be reached (not running, wrong socket, connection lost)."""

    code = "daemon_unavailable"


class BadReply(WcdError):
    """Client side only: a reply does not decode as what was asked for (an entry another uid
    crafted, a daemon of another version). The message says which reply and what was wrong."""

    code = "bad_reply"


class ConfigError(WcdError):
    """Local only: the configuration file is wrong. The message names the field."""

    code = "config_error"


_BY_CODE: dict[str, type[WcdError]] = {
    cls.code: cls
    for cls in (
        Internal,
        BadRequest,
        ProtocolError,
        UnsupportedVersion,
        NotFound,
        KeyMismatch,
        Busy,
        OutOfMemory,
        PermissionDenied,
        LeaseExpired,
        LoadFailed,
        DeviceUnavailable,
        DaemonUnavailable,
        BadReply,
    )
}


def from_wire(error: Any) -> WcdError:
    """Rebuild the exception a daemon reported; unknown codes keep their code on a plain WcdError."""
    if not isinstance(error, dict):
        return Internal(f"malformed error reply: {error!r:.200}")
    code = str(error.get("code", "internal"))
    message = str(error.get("message", ""))
    details = error.get("details")
    cls = _BY_CODE.get(code)
    if cls is None:
        exc = WcdError(message, details if isinstance(details, dict) else None)
        exc.code = code  # type: ignore[misc]
        return exc
    return cls(message, details if isinstance(details, dict) else None)
