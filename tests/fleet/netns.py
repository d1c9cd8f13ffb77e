"""Network namespaces for the fleet tests: one per daemon, joined by veth pairs, made and removed
by the test (traffic only to addresses inside namespaces it made). Needs root and `ip`."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def usable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.getuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


@dataclass
class Net:
    """Namespaces `prefix-0..n-1`; namespace i has address 10.RR.0.(i+1) on one bridge-less star:
    namespace 0 is joined to each other one by a veth pair (subnet 10.RR.i.0/24)."""

    prefix: str
    count: int
    names: list[str] = field(default_factory=list)
    links: dict[int, tuple[str, str]] = field(default_factory=dict)  # i -> (veth in ns 0, veth in ns i)

    def __post_init__(self) -> None:
        self.octet = 100 + os.getpid() % 100
        try:
            for i in range(self.count):
                name = f"{self.prefix}-{i}"
                _ip("netns", "add", name)
                self.names.append(name)
                _ip("link", "set", "lo", "up", netns=name)
            for i in range(1, self.count):
                a, b = f"wf{os.getpid() % 10000}a{i}", f"wf{os.getpid() % 10000}b{i}"
                _ip("link", "add", a, "netns", self.names[0], "type", "veth", "peer", "name", b,
                    "netns", self.names[i])
                self.links[i] = (a, b)
                _ip("addr", "add", f"10.{self.octet}.{i}.1/24", "dev", a, netns=self.names[0])
                _ip("addr", "add", f"10.{self.octet}.{i}.2/24", "dev", b, netns=self.names[i])
                _ip("link", "set", a, "up", netns=self.names[0])
                _ip("link", "set", b, "up", netns=self.names[i])
        except BaseException:
            self.remove()
            raise

    def address(self, i: int, towards: int = 0) -> str:
        """Namespace i's address on its link with `towards` (0 for i > 0, else the link to `towards`)."""
        return f"10.{self.octet}.{i}.2" if i else f"10.{self.octet}.{towards}.1"

    def device(self, i: int, towards: int = 0) -> str:
        return self.links[i][1] if i else self.links[towards][0]

    def prefix_cmd(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def link(self, i: int, up: bool) -> None:
        """Cut (or restore) namespace i's link to namespace 0, on its side."""
        _ip("link", "set", self.links[i][1], "up" if up else "down", netns=self.names[i])

    def remove(self) -> None:
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)  # its veths go with it
        self.names.clear()
