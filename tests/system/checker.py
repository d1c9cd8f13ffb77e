"""Runs inside the test container, under the container's own python3 (no torch, no numpy).

    checker.py make PATH --seed N [--shards K] [--tensors T]   write a safetensors checkpoint (a directory of K
                                                  shards, or one file when PATH ends in .safetensors)
    checker.py check SOCKET NAME PATH             attach NAME through wcd.client and compare every
                                                  tensor's bytes with the checkpoint at PATH

Both print one JSON line: the checkpoint's tensor count, byte count and a digest over all tensors.
The safetensors format is parsed and written here with the stdlib only (8-byte little-endian
header length, JSON header, raw data), independently of wcd's own parser.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import sys
from pathlib import Path

DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def make(path: Path, seed: int, shards: int, count: int = 30) -> dict:
    rng = random.Random(seed)
    names = list(DTYPES)
    tensors: list[tuple[str, str, list[int], bytes]] = []
    for i in range(count):
        dtype = names[i % len(names)]
        if i == 7:
            shape: list[int] = []  # a scalar
        else:  # past 30 tensors, small ones (a MoE checkpoint's many experts: a large header)
            shape = [rng.randint(1, 700 if count <= 30 else 8) for _ in range(rng.randint(1, 3))]
            while _count(shape) * DTYPES[dtype] > 2_000_000:
                shape[0] = max(1, shape[0] // 2)
        n = _count(shape) * DTYPES[dtype]
        data = rng.randbytes(n)
        if dtype == "BOOL":
            data = data.translate(bytes(b & 1 for b in range(256)))
        tensors.append((f"layers.{i}.{dtype.lower()}", dtype, shape, data))
    if path.suffix == ".safetensors":
        files = [(path, tensors)]
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        path.mkdir(parents=True, exist_ok=True)
        files = [(path / f"model-{k + 1:05d}-of-{shards:05d}.safetensors", tensors[k::shards]) for k in range(shards)]
    for file, part in files:
        header: dict = {"__metadata__": {"format": "pt", "writer": "wcd tests/system/checker.py"}}
        offset = 0
        rng.shuffle(part)  # data order differs from name order
        for name, dtype, shape, data in part:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for _, _, _, data in part:
                f.write(data)
        os.chmod(file, 0o644)
    if path.is_dir():
        os.chmod(path, 0o755)
    return summary(read_checkpoint(path))


def read_checkpoint(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        sys.exit(f"checker: no .safetensors files in {path}")
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for file in files:
        blob = file.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            assert name not in out, f"{name} in two shards"
            out[name] = (info["dtype"], list(info["shape"]), blob[8 + n + begin : 8 + n + end])
    return out


def summary(tensors: dict[str, tuple[str, list[int], bytes]]) -> dict:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        digest.update(f"{name}:{dtype}:{shape}:{len(data)}\n".encode())
        digest.update(data)
    return {"tensors": len(tensors), "bytes": sum(len(t[2]) for t in tensors.values()), "digest": digest.hexdigest()}


def check(socket_path: str, name: str, path: Path) -> dict:
    from wcd.client import Client  # the low-level request and the manifest's own decoder, no torch views
    from wcd.manifest import Manifest

    expected = read_checkpoint(path)
    with Client(socket_path, name="tests/system checker", heartbeats=False) as client:
        reply, fds = client.request_fds("acquire", name=name)
        try:
            if len(fds) != 1:
                sys.exit(f"checker: acquire returned {len(fds)} fds, expected 1")
            arena, rows = reply["arena"], Manifest.from_wire(reply["manifest"]).tensors
            if arena["kind"] != "host":
                sys.exit(f"checker: arena kind {arena['kind']!r}, expected 'host'")
            with mmap.mmap(fds[0], arena["size"], flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
                got: dict[str, tuple[str, list[int], bytes]] = {}
                for t in rows:
                    got[t.name] = (t.dtype, list(t.shape), m[t.offset : t.offset + t.nbytes])
        finally:
            for fd in fds:
                os.close(fd)
            client.request("release", lease=reply["lease"])
    if set(got) != set(expected):
        sys.exit(f"checker: tensor names differ: missing {sorted(set(expected) - set(got))[:5]}, "
                 f"unexpected {sorted(set(got) - set(expected))[:5]}")
    bad = [t for t in expected if got[t] != expected[t]]
    if bad:
        t = bad[0]
        sys.exit(f"checker: {len(bad)} of {len(expected)} tensors differ, first {t}: dtype/shape "
                 f"{got[t][:2]} vs {expected[t][:2]}, bytes equal: {got[t][2] == expected[t][2]}")
    return {**summary(got), "lease": reply["lease"], "arena_size": arena["size"]}


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("path", type=Path)
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--shards", type=int, default=1)
    m.add_argument("--tensors", type=int, default=30)
    c = sub.add_parser("check")
    c.add_argument("socket")
    c.add_argument("name")
    c.add_argument("path", type=Path)
    args = parser.parse_args()
    if args.cmd == "make":
        result = make(args.path, args.seed, args.shards, args.tensors)
    else:
        result = check(args.socket, args.name, args.path)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
