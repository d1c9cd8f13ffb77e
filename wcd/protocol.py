"""Request schemas: every request the daemon accepts, validated with explicit bounds.

The daemon validates each decoded request against its op's pydantic schema before it looks at it;
a schema is built at the first request of its op, not at import (`wcd serve` is not READY until
the imports are done). The framing, versions and reply envelopes live in `wcd.wire` (re-exported
here for the daemon), which clients use without importing pydantic. No sockets here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictBytes,
    StrictInt,
    StrictStr,
    StringConstraints,
    ValidationError,
)

from wcd.errors import BadRequest
from wcd.key import WeightCacheKey
from wcd.manifest import MAX_NAME_LEN, MAX_NDIM, MAX_TENSORS, has_control
from wcd.wire import (  # noqa: F401 - the daemon's one import for the protocol
    MAX_FDS_PER_FRAME,
    MAX_FRAME_BYTES,
    MAX_LEASES_PER_HEARTBEAT,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    FrameDecoder,
    Retention,
    encode,
    error,
    fds_from_ancillary,
    ok,
)


def _no_control(name: str) -> str:
    """Entry names hold no control characters: they would forge log lines, and clients refuse them."""
    if has_control(name):
        raise ValueError("control characters are not allowed in entry names")
    return name


Name = Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(_no_control)]
LEASES_PER_PAGE = 1000  # a `leases` reply lists at most these; the client asks for the next page
# A series' name: printable, no '@' (its generations are named series@N) and no control characters.
SeriesName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^@\x00-\x1f\x7f]+$")]


# ---------------------------------------------------------------------------------------------
# Requests. Every field is bounded; unknown fields are refused so typos fail loudly.


class _Req(BaseModel):
    # defer_build: building the 15 schemas took ~8 ms of the daemon's start-up before READY; each
    # is built at its op's first request instead (0.2-1 ms, once).
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
    id: Annotated[StrictInt, Field(ge=0, lt=1 << 63)]


class Hello(_Req):
    op: Literal["hello"]
    versions: Annotated[list[StrictInt], Field(min_length=1, max_length=16)]
    client: Annotated[str, StringConstraints(max_length=256)] = ""


class Ping(_Req):
    op: Literal["ping"]


class Status(_Req):
    op: Literal["status"]


class ListEntries(_Req):
    op: Literal["list"]


class Leases(_Req):
    """A page of leases: ids above `after`, at most `limit`."""

    op: Literal["leases"]
    after: Annotated[StrictInt, Field(ge=0)] = 0
    limit: Annotated[StrictInt, Field(ge=1, le=LEASES_PER_PAGE)] = LEASES_PER_PAGE


class _Target(_Req):
    """An entry named either by its unique entry name or by its full key."""

    name: Name | None = None
    key: WeightCacheKey | None = None

    def target(self) -> str | WeightCacheKey:
        if (self.name is None) == (self.key is None):
            raise BadRequest("give exactly one of 'name' or 'key'")
        return self.name if self.name is not None else self.key  # type: ignore[return-value]


class _Generation(_Target):
    """An entry, or the current generation of a series (`series`)."""

    series: SeriesName | None = None

    def series_target(self) -> str | None:
        """The series asked for, if any (then neither a name nor a key may be given)."""
        if self.series is not None and (self.name is not None or self.key is not None):
            raise BadRequest("give exactly one of 'name', 'key' or 'series'")
        return self.series


class Acquire(_Generation):
    """`digest`: the full content digest (as `verify` reports it) the reader wants checked: an
    entry holding other bytes is refused `key_mismatch`."""

    op: Literal["acquire"]
    wait: StrictBool = True
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 3600.0
    digest: Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")] | None = None


class Heartbeat(_Req):
    op: Literal["heartbeat"]
    leases: Annotated[list[StrictInt], Field(max_length=MAX_LEASES_PER_HEARTBEAT)]


class Release(_Req):
    op: Literal["release"]
    lease: StrictInt


class TensorColumns(BaseModel):
    """A reserve's tensors as columns (see `Manifest.to_wire`), so 10^5 tensors
    cost the loop a few bounded strings here; `Manifest.layout_columns` checks them in a thread."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
    names: Annotated[StrictStr, StringConstraints(max_length=MAX_TENSORS * (MAX_NAME_LEN + 1))]
    dtypes: Annotated[StrictBytes, Field(max_length=MAX_TENSORS)]
    shape_ndims: Annotated[StrictBytes, Field(max_length=MAX_TENSORS)]
    shape_dims: Annotated[StrictBytes, Field(max_length=8 * MAX_NDIM * MAX_TENSORS)]
    shape_ids: Annotated[StrictBytes, Field(max_length=4 * MAX_TENSORS)]


class Reserve(_Req):
    op: Literal["reserve"]
    key: WeightCacheKey
    columns: TensorColumns
    retention: Retention = "cached"
    series: SeriesName | None = None  # reserve the next generation of this series


class Commit(_Req):
    op: Literal["commit"]
    lease: StrictInt


class Abort(_Req):
    op: Literal["abort"]
    lease: StrictInt


class Load(_Req):
    op: Literal["load"]
    name: Name
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None
    device: Annotated[str, StringConstraints(max_length=256)] | None = None
    retention: Retention | None = None
    wait: StrictBool = False


class Evict(_Target):
    op: Literal["evict"]


class Verify(_Target):
    op: Literal["verify"]


class MetricsRequest(_Req):
    op: Literal["metrics"]


class Watch(_Req):
    """Be told over this connection when a generation of `series` becomes current (an event
    frame: no id, `event: "generation"`); `stop` ends that."""

    op: Literal["watch"]
    series: SeriesName
    stop: StrictBool = False


class Rollback(_Req):
    op: Literal["rollback"]
    series: SeriesName
    generation: Annotated[StrictInt, Field(ge=1, lt=1 << 62)] | None = None


_REQUESTS: tuple[type[_Req], ...] = (Hello, Ping, Status, ListEntries, Leases, Acquire, Heartbeat, Release,
                                     Reserve, Commit, Abort, Load, Evict, Verify, MetricsRequest, Watch, Rollback)
SCHEMAS: dict[str, type[_Req]] = {m.model_fields["op"].annotation.__args__[0]: m  # type: ignore[union-attr]
                                  for m in _REQUESTS}
OPS: tuple[str, ...] = tuple(SCHEMAS)


def unbuilt() -> list[type[_Req]]:
    """The request schemas no request has built yet (the daemon builds them one by one after READY)."""
    return [schema for schema in _REQUESTS if not schema.__pydantic_complete__]


def parse_request(message: dict[str, Any]) -> Any:
    """Validate one decoded request against its op's schema. Raises `BadRequest` with a one-line reason."""
    op = message.get("op")
    schema = SCHEMAS.get(op) if type(op) is str else None
    if schema is None:
        raise BadRequest(f"unknown op {op!r:.40}; known ops: {', '.join(OPS)}")
    try:
        return schema.model_validate(message)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "request"
        raise BadRequest(f"{op}: {where}: {err['msg']}") from None
