"""Protocol v1 codec and request schemas, driven without sockets (bytes and fake fds in)."""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wcd import errors, protocol, wire
from wcd.errors import BadRequest, ProtocolError
from wcd.key import WeightCacheKey
from wcd.protocol import FrameDecoder, encode, parse_request

SETTINGS = settings(max_examples=60, deadline=None)

# -- strategies ---------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25,
)
# "nfds" is the framing layer's own field: the decoder consumes it.
messages = st.dictionaries(st.text(max_size=16).filter(lambda k: k != "nfds"), _values, max_size=8)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def drain(dec: FrameDecoder) -> list[tuple[dict[str, Any], list[int]]]:
    out = []
    while (item := dec.next_message()) is not None:
        out.append(item)
    return out


def chunks(data: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    """`data` split at the given positions, as (start offset, piece) pairs."""
    bounds = [0, *sorted(set(cuts)), len(data)]
    return [(a, data[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


# -- encode / FrameDecoder round trips ----------------------------------------------------------


def test_encode_is_length_prefixed_msgpack_map() -> None:
    data = encode({"op": "ping", "id": 7})
    (n,) = struct.unpack(">I", data[:4])
    assert n == len(data) - 4
    assert msgpack.unpackb(data[4:], raw=False) == {"op": "ping", "id": 7}


def test_encode_announces_fds_and_decoder_strips_the_field() -> None:
    data = encode({"id": 1, "ok": True}, nfds=2)
    assert msgpack.unpackb(data[4:], raw=False)["nfds"] == 2
    dec = FrameDecoder()
    dec.feed(data, [40, 41])
    assert drain(dec) == [({"id": 1, "ok": True}, [40, 41])]


def test_encode_refuses_oversize_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 100)
    encode({"blob": b"x" * 50})
    with pytest.raises(BadRequest, match="frame limit"):
        encode({"blob": b"x" * 200})


@SETTINGS
@given(msg=messages)
def test_round_trip_one_message(msg: dict[str, Any]) -> None:
    dec = FrameDecoder()
    dec.feed(encode(msg))
    assert drain(dec) == [(msg, [])]
    assert dec.buffered == 0


@SETTINGS
@given(msgs=st.lists(messages, min_size=1, max_size=6), data=st.data())
def test_round_trip_split_at_arbitrary_points(msgs: list[dict[str, Any]], data: st.DataObject) -> None:
    stream = b"".join(encode(m) for m in msgs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    dec = FrameDecoder()
    got = []
    for _, piece in chunks(stream, cuts):
        dec.feed(piece)
        got += drain(dec)
    assert got == [(m, []) for m in msgs]
    assert dec.buffered == 0


@settings(max_examples=15, deadline=None)
@given(msgs=st.lists(messages, min_size=1, max_size=3))
def test_round_trip_one_byte_at_a_time(msgs: list[dict[str, Any]]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    dec = FrameDecoder()
    got = []
    for i in range(len(stream)):
        dec.feed(stream[i : i + 1])
        got += drain(dec)
        if i < len(stream) - 1:
            assert len(got) < len(msgs)
    assert got == [(m, []) for m in msgs]


def test_concatenated_frames_in_one_feed() -> None:
    msgs = [{"op": "ping", "id": i} for i in range(5)]
    dec = FrameDecoder()
    dec.feed(b"".join(encode(m) for m in msgs))
    assert [m for m, _ in drain(dec)] == msgs


def test_incomplete_frame_waits_for_more_bytes() -> None:
    data = encode({"op": "ping", "id": 1})
    dec = FrameDecoder()
    dec.feed(data[:3])
    assert dec.next_message() is None
    dec.feed(data[3:-1])
    assert dec.next_message() is None
    assert dec.buffered == len(data) - 1
    dec.feed(data[-1:])
    assert dec.next_message() == ({"op": "ping", "id": 1}, [])


# -- fd pairing ---------------------------------------------------------------------------------


@SETTINGS
@given(
    frames=st.lists(st.tuples(messages, st.integers(0, protocol.MAX_FDS_PER_FRAME // 4)), min_size=1, max_size=6),
    data=st.data(),
)
def test_fds_pair_with_the_frame_that_announces_them(
    frames: list[tuple[dict[str, Any], int]], data: st.DataObject
) -> None:
    # Each frame's fds arrive with its first byte, whatever piece of the stream that byte is in.
    stream, starts, expected = b"", [], []
    next_fd = 100
    for msg, nfds in frames:
        starts.append(len(stream))
        stream += encode(msg, nfds)
        fds = list(range(next_fd, next_fd + nfds))
        next_fd += nfds
        expected.append((msg, fds))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    dec = FrameDecoder()
    got = []
    for begin, piece in chunks(stream, cuts):
        fds = [fd for (s, (_, f)) in zip(starts, expected) if begin <= s < begin + len(piece) for fd in f]
        dec.feed(piece, fds)
        got += drain(dec)
    assert got == expected
    assert dec.take_fds() == []


def test_fds_fed_early_are_claimed_in_order() -> None:
    dec = FrameDecoder()
    dec.feed(b"", [3, 4, 5, 6])
    dec.feed(encode({"a": 1}, 1) + encode({"b": 2}) + encode({"c": 3}, 2))
    assert drain(dec) == [({"a": 1}, [3]), ({"b": 2}, []), ({"c": 3}, [4, 5])]
    assert dec.take_fds() == [6]


def test_frame_announcing_more_fds_than_arrived() -> None:
    dec = FrameDecoder()
    dec.feed(encode({"a": 1}, 3), [7, 8])
    with pytest.raises(ProtocolError, match="announces 3 file descriptors but 2 arrived"):
        dec.next_message()
    assert dec.take_fds() == [7, 8]


@pytest.mark.parametrize("nfds", [-1, protocol.MAX_FDS_PER_FRAME + 1, "2", 1.0, True, None, [1]])
def test_bad_nfds_values(nfds: Any) -> None:
    dec = FrameDecoder()
    dec.feed(frame(msgpack.packb({"op": "ping", "nfds": nfds})), list(range(20)))
    with pytest.raises(ProtocolError, match="bad nfds"):
        dec.next_message()


def test_explicit_zero_nfds_claims_nothing() -> None:
    dec = FrameDecoder()
    dec.feed(frame(msgpack.packb({"op": "ping", "nfds": 0})), [9])
    assert drain(dec) == [({"op": "ping"}, [])]
    assert dec.take_fds() == [9]


def test_max_fds_per_frame_is_accepted() -> None:
    n = protocol.MAX_FDS_PER_FRAME
    dec = FrameDecoder()
    dec.feed(encode({"x": 1}, n), list(range(n)))
    assert drain(dec) == [({"x": 1}, list(range(n)))]


def test_too_many_unclaimed_fds() -> None:
    dec = FrameDecoder()
    limit = 4 * protocol.MAX_FDS_PER_FRAME
    dec.feed(b"", list(range(limit)))
    with pytest.raises(ProtocolError, match="unclaimed file descriptors"):
        dec.feed(b"", [limit])
    assert dec.take_fds() == list(range(limit + 1))  # every fd is handed back to be closed


def test_take_fds_returns_unclaimed_once() -> None:
    dec = FrameDecoder()
    dec.feed(encode({"a": 1}, 1), [11, 12, 13])
    assert drain(dec) == [({"a": 1}, [11])]
    assert dec.take_fds() == [12, 13]
    assert dec.take_fds() == []


# -- limits and malformed input -----------------------------------------------------------------


def test_frame_at_the_limit_is_accepted() -> None:
    body = msgpack.packb({"k": "x" * 90})
    dec = FrameDecoder(max_frame=len(body))
    dec.feed(frame(body))
    assert drain(dec) == [({"k": "x" * 90}, [])]


def test_oversize_frame_refused_from_its_length_alone() -> None:
    dec = FrameDecoder(max_frame=100)
    dec.feed(struct.pack(">I", 101))  # no body byte has arrived yet
    with pytest.raises(ProtocolError, match="101 bytes exceeds the 100-byte limit"):
        dec.next_message()


def test_oversize_frame_refused_before_body_is_complete() -> None:
    dec = FrameDecoder(max_frame=100)
    dec.feed(encode({"a": 1}))
    dec.feed(struct.pack(">I", 1 << 30) + b"\x80" * 10)
    assert dec.next_message() == ({"a": 1}, [])
    with pytest.raises(ProtocolError, match="exceeds"):
        dec.next_message()
    assert dec.buffered < 100


@pytest.mark.parametrize(
    "body",
    [
        b"",  # empty frame
        b"\xc1",  # a byte msgpack never uses
        b"\x82\xa1a\x01",  # map announces 2 pairs, holds 1
        msgpack.packb([1, 2, 3]),
        msgpack.packb("ping"),
        msgpack.packb(5),
        msgpack.packb(None),
        msgpack.packb({1: "int key"}),
        msgpack.packb({"a": 1}) + msgpack.packb({"b": 2}),  # two objects in one frame
    ],
    ids=["empty", "reserved-byte", "short-map", "array", "str", "int", "nil", "int-key", "two-objects"],
)
def test_malformed_frame_bodies(body: bytes) -> None:
    dec = FrameDecoder()
    dec.feed(frame(body))
    with pytest.raises(ProtocolError):
        dec.next_message()


def test_oversize_array_inside_frame() -> None:
    """A request holds no array longer than a heartbeat's; a reply reader may take longer ones."""
    n = protocol.MAX_LEASES_PER_HEARTBEAT
    dec = FrameDecoder()
    dec.feed(frame(msgpack.packb({"leases": [0] * n})))
    assert dec.next_message() == ({"leases": [0] * n}, [])
    dec.feed(frame(msgpack.packb({"tensors": [["w", "F32", [1]]] * (n + 1)})))
    with pytest.raises(ProtocolError, match=f"longer than {n} items"):
        dec.next_message()
    replies = FrameDecoder(max_array=wire.MAX_REPLY_ARRAY)
    replies.feed(frame(msgpack.packb({"entries": [{}] * (n + 1)})))
    assert len(replies.next_message()[0]["entries"]) == n + 1  # type: ignore[index]


@SETTINGS
@given(garbage=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=5))
def test_garbage_never_escapes_as_another_exception(garbage: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(max_frame=1000)
    try:
        for _, piece in chunks(garbage, [c for c in cuts if c <= len(garbage)]):
            dec.feed(piece)
            for msg, fds in drain(dec):
                assert isinstance(msg, dict) and fds == []
    except ProtocolError:
        pass


# -- requests -----------------------------------------------------------------------------------

# One F32 tensor "a" of shape (2,), as a reserve's columns.
COLUMNS = {"names": "a", "dtypes": b"\x0e", "shape_ndims": b"\x01", "shape_dims": b"\x02" + b"\0" * 7,
           "shape_ids": b"\0\0\0\0"}

MINIMAL: dict[str, dict[str, Any]] = {
    "hello": {"versions": [2]},
    "ping": {},
    "status": {},
    "list": {},
    "leases": {},
    "acquire": {"name": "m"},
    "heartbeat": {"leases": []},
    "release": {"lease": 1},
    "reserve": {"key": {"model": "m"}, "columns": COLUMNS},
    "commit": {"lease": 1},
    "abort": {"lease": 1},
    "load": {"name": "m"},
    "evict": {"name": "m"},
    "verify": {"key": {"model": "m"}},
    "metrics": {},
    "watch": {"series": "s"},
    "rollback": {"series": "s"},
}


def req(op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, "id": 3, **MINIMAL[op], **fields}


def bad_request(message: dict[str, Any]) -> str:
    with pytest.raises(BadRequest) as info:
        parse_request(message)
    text = info.value.message
    assert "\n" not in text
    return text


def test_minimal_requests_cover_every_op() -> None:
    assert set(MINIMAL) == set(protocol.OPS)


@pytest.mark.parametrize("op", protocol.OPS)
def test_every_op_accepts_a_minimal_request(op: str) -> None:
    parsed = parse_request(req(op))
    assert parsed.op == op and parsed.id == 3


@pytest.mark.parametrize("op", protocol.OPS)
def test_every_op_refuses_an_extra_field(op: str) -> None:
    assert bad_request(req(op, colour="blue")) == f"{op}: colour: Extra inputs are not permitted"


@pytest.mark.parametrize("op", protocol.OPS)
def test_every_op_requires_an_id(op: str) -> None:
    message = req(op)
    del message["id"]
    assert bad_request(message).startswith(f"{op}: id: ")


@pytest.mark.parametrize("op", ["frobnicate", "", None, 5, ["ping"]])
def test_unknown_op(op: Any) -> None:
    text = bad_request({"op": op, "id": 1})
    assert text.startswith("unknown op") and "known ops: hello" in text


def test_missing_op() -> None:
    assert bad_request({"id": 1}).startswith("unknown op None")


def test_parsed_request_carries_typed_fields() -> None:
    r = parse_request(req("reserve", retention="ephemeral"))
    assert r.key == WeightCacheKey(model="m")
    assert r.columns.names == "a" and r.columns.shape_dims == COLUMNS["shape_dims"]
    assert r.retention == "ephemeral"
    a = parse_request(req("acquire"))
    assert (a.wait, a.timeout_s) == (True, 3600.0)


@pytest.mark.parametrize(
    ("op", "fields", "where"),
    [
        ("release", {"lease": "seven"}, "lease"),
        ("commit", {"lease": None}, "lease"),
        ("hello", {"versions": "1"}, "versions"),
        ("hello", {"versions": []}, "versions"),
        ("hello", {"versions": list(range(17))}, "versions"),
        ("hello", {"client": 5}, "client"),
        ("ping", {"id": -1}, "id"),
        ("ping", {"id": 1 << 63}, "id"),
        ("ping", {"id": "1x"}, "id"),
        ("acquire", {"wait": "perhaps"}, "wait"),
        ("acquire", {"timeout_s": 0}, "timeout_s"),
        ("acquire", {"timeout_s": 24 * 3600 + 1}, "timeout_s"),
        ("acquire", {"key": {"model": "m", "shard": {"tp": "x"}}, "name": None}, "key.shard.tp"),
        ("acquire", {"key": {"model": "m", "colour": 1}, "name": None}, "key.colour"),
        ("heartbeat", {"leases": ["a"]}, "leases.0"),
        ("reserve", {"columns": {**COLUMNS, "dtypes": "x"}}, "columns.dtypes"),
        ("reserve", {"tensors": [["w", "F32", [1]]]}, "tensors"),  # protocol v1's rows
        ("reserve", {"retention": "forever"}, "retention"),
        ("reserve", {"key": {"model": ""}}, "key.model"),
        ("load", {"retention": "forever"}, "retention"),
        ("load", {"wait": []}, "wait"),
    ],
)
def test_wrong_types_name_the_field(op: str, fields: dict[str, Any], where: str) -> None:
    assert bad_request(req(op, **fields)).startswith(f"{op}: {where}: ")


@pytest.mark.parametrize(
    ("op", "fields", "where"),
    [
        ("hello", {"client": "c" * 257}, "client"),
        ("acquire", {"name": "n" * 257}, "name"),
        ("acquire", {"name": ""}, "name"),
        ("load", {"name": "n" * 257}, "name"),
        ("load", {"path": "/" * 4097}, "path"),
        ("load", {"device": "d" * 257}, "device"),
        ("reserve", {"columns": {**COLUMNS, "dtypes": b"x" * (protocol.MAX_TENSORS + 1)}}, "columns.dtypes"),
        ("reserve", {"key": {"model": "m", "path": "p" * 1025}}, "key.path"),
        ("reserve", {"key": {"model": "m", "extra": {"k" * 257: "v"}}}, "key.extra"),
    ],
)
def test_oversize_strings_name_the_field(op: str, fields: dict[str, Any], where: str) -> None:
    text = bad_request(req(op, **fields))
    assert text.startswith(f"{op}: {where}")
    assert "at most" in text or "at least" in text


def test_string_limits_are_inclusive() -> None:
    parse_request(req("hello", client="c" * 256))
    parse_request(req("load", name="n" * 256, path="/" * 4096))
    parse_request(req("reserve", columns={**COLUMNS, "dtypes": b"x" * protocol.MAX_TENSORS}))


def test_too_many_heartbeat_ids() -> None:
    n = protocol.MAX_LEASES_PER_HEARTBEAT
    assert len(parse_request(req("heartbeat", leases=list(range(n)))).leases) == n
    assert bad_request(req("heartbeat", leases=list(range(n + 1)))).startswith("heartbeat: leases: ")


# -- targets and replies ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["acquire", "evict", "verify"])
def test_target_by_name_or_key(op: str) -> None:
    by_name = parse_request({"op": op, "id": 1, "name": "llama#1"})
    assert by_name.target() == "llama#1"
    by_key = parse_request({"op": op, "id": 1, "key": {"model": "llama", "dtype": "bf16"}})
    assert by_key.target() == WeightCacheKey(model="llama", dtype="bf16")


@pytest.mark.parametrize("op", ["acquire", "evict", "verify"])
@pytest.mark.parametrize("fields", [{}, {"name": "a", "key": {"model": "a"}}], ids=["neither", "both"])
def test_target_requires_exactly_one_of_name_and_key(op: str, fields: dict[str, Any]) -> None:
    parsed = parse_request({"op": op, "id": 1, **fields})
    with pytest.raises(BadRequest, match="exactly one of 'name' or 'key'"):
        parsed.target()


def test_ok_reply_shape() -> None:
    assert protocol.ok(4) == {"id": 4, "ok": True}
    assert protocol.ok(4, lease=9, entry="m") == {"id": 4, "ok": True, "lease": 9, "entry": "m"}


def test_error_reply_shape_and_round_trip() -> None:
    err = errors.KeyMismatch("differs", {"fields": ["dtype"]})
    reply = protocol.error(8, err)
    assert reply == {"id": 8, "ok": False,
                     "error": {"code": "key_mismatch", "message": "differs", "details": {"fields": ["dtype"]}}}
    dec = FrameDecoder()
    dec.feed(encode(reply))
    ((decoded, _),) = drain(dec)
    back = errors.from_wire(decoded["error"])
    assert type(back) is errors.KeyMismatch and back.details == {"fields": ["dtype"]}
    assert protocol.error(None, errors.ProtocolError("bad"))["id"] is None


@pytest.mark.parametrize("message", [
    {"op": "release", "id": 1, "lease": "3"},
    {"op": "commit", "id": 1, "lease": 3.0},
    {"op": "heartbeat", "id": 1, "leases": [True]},
    {"op": "acquire", "id": 1, "name": "x", "wait": "yes"},
    {"op": "ping", "id": 1.0},
    {"op": "hello", "id": 1, "versions": ["1"]},
    {"op": "reserve", "id": 1, "key": {"model": "m"}, "columns": {**COLUMNS, "dtypes": [14]}},
])
def test_requests_are_strict_about_ints_and_bools(message: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        parse_request(message)


def test_request_schemas_are_built_at_their_first_request_not_at_start_up() -> None:
    """`wcd serve` imports the protocol before READY; its schemas wait for their op's first request
    (a fresh process: this session's other tests have built them). The first request of an op,
    valid or not, is answered as ever: bad ones with their one line."""
    code = """if True:
        import sys, wcd.cli.wcd, wcd.config, wcd.server
        from wcd import protocol
        from wcd.errors import BadRequest
        print(sorted(op for op, schema in protocol.SCHEMAS.items() if schema.__pydantic_complete__))
        print(protocol.parse_request({"op": "ping", "id": 1}).id)
        try:
            protocol.parse_request({"op": "hello", "id": 2, "versions": []})
        except BadRequest as e:
            print(e.message)
        print(sorted(op for op, schema in protocol.SCHEMAS.items() if schema.__pydantic_complete__))
    """
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.splitlines() == ["[]", "1", "hello: versions: List should have at least 1 item after validation, not 0",
                                "['hello', 'ping']"]


def test_the_daemons_warm_up_builds_every_schema_one_per_loop_turn() -> None:
    """After READY the server builds the schemas no request has built, one per turn of the loop
    (a request waits behind one build at most); requests are answered the same after it."""
    code = """if True:
        import asyncio
        from wcd import protocol
        from wcd.server import Server
        total = len(protocol.unbuilt())
        turns = []

        async def main():
            async def count():
                while protocol.unbuilt():
                    turns.append(len(protocol.unbuilt()))
                    await asyncio.sleep(0)
            await asyncio.gather(Server._warm_schemas(), count())

        asyncio.run(main())
        print(total, len(protocol.unbuilt()), max(a - b for a, b in zip(turns, turns[1:] + [0])))
        print(protocol.parse_request({"op": "ping", "id": 1}).id)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    total, left, most_per_turn = map(int, out.stdout.split()[:3])
    assert total == len(protocol.OPS) and left == 0 and most_per_turn == 1
    assert out.stdout.split()[3] == "1"


@pytest.mark.parametrize("series", ["a@1", "", "x\ny", "\x7f"])
def test_a_series_name_has_no_at_sign_nor_control_characters(series: str) -> None:
    assert "series" in bad_request(req("watch", series=series))
