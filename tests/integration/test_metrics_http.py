"""`[daemon] metrics_listen`: a real daemon answering real HTTP requests for /metrics, and nothing else."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_daemon import model_config
from wcd.metrics_http import MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S


def metrics_url(daemon) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.search(r"metrics on (http://\S+)", daemon.log.read_text())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(daemon.log.read_text())


def raw_request(url: str, data: bytes) -> bytes:
    host, port = url.split("/")[2].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_prometheus_scrapes_metrics_over_http(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon('metrics_listen = "127.0.0.1:0"\n' + model_config(path))
    url = metrics_url(d)
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    with d.client() as c, c.acquire("m"):
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            text = r.read().decode()
        # The same registry as `wcdctl metrics`: state read at scrape time.
        assert 'wcd_leases{kind="read"} 1.0' in text
        assert re.search(r'wcd_device_used_bytes\{device="cpu"\} [1-9]', text)
        assert 'wcd_entries{state="ready"} 1.0' in text
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.replace("/metrics", "/"), timeout=30)
    assert e.value.code == 404
    e.value.close()  # an HTTPError holds the response and its socket
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, data=b"x", method="POST"), timeout=30)
    assert e.value.code == 405
    e.value.close()
    assert raw_request(url, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * MAX_REQUEST_BYTES + b"\r\n\r\n").startswith(
        b"HTTP/1.1 431 ")
    assert raw_request(url, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert d.stop() == 0


@pytest.mark.slow
def test_a_slow_client_holds_neither_the_endpoint_nor_the_daemon(make_daemon):
    d = make_daemon('metrics_listen = "127.0.0.1:0"\n')
    url = metrics_url(d)
    host, port = url.split("/")[2].rsplit(":", 1)
    slow = socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S + 10)
    slow.sendall(b"GET /metr")  # and nothing more
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
    with d.client() as c:
        c.ping()
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    reply = slow.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert REQUEST_TIMEOUT_S - 1 < time.monotonic() - started < REQUEST_TIMEOUT_S + 5
    slow.close()


def test_metrics_off_by_default(make_daemon):
    d = make_daemon()
    assert "metrics on" not in d.log.read_text()


@pytest.mark.parametrize("listen", ["9464", "localhost", "127.0.0.1:70000", "[::1]"])
def test_metrics_listen_must_be_host_port(tmp_path: Path, listen: str):
    cfg = tmp_path / "wcd.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path / "s.sock"}"\nmetrics_listen = "{listen}"\n')
    out = subprocess.run([sys.executable, "-m", "wcd", "serve", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "daemon.metrics_listen: expected host:port" in out.stderr


def test_a_taken_port_is_one_line(make_daemon, tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        d = make_daemon(f'metrics_listen = "127.0.0.1:{port}"\n', start=False)
        out = subprocess.run([sys.executable, "-m", "wcd", "serve", "--config", str(d.config)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"wcd: daemon.metrics_listen: cannot listen on 127.0.0.1:{port} (Address already in use)")


def test_a_sandbox_without_tcp_is_one_line_pointing_at_the_drop_in(monkeypatch: pytest.MonkeyPatch):
    """What RestrictAddressFamilies=AF_UNIX does to socket(AF_INET): refused, not silently unserved
    (make test-system shows it under the real unit)."""
    import errno

    from wcd import metrics_http
    from wcd.errors import ConfigError

    def refused(*args: object) -> socket.socket:
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(metrics_http.socket, "socket", refused)
    with pytest.raises(ConfigError, match=r"cannot listen on 127\.0\.0\.1:9464 \(Address family not supported "
                                          r"by protocol\); under wcd@\.service allow TCP with a drop-in"):
        metrics_http.MetricsHttp("127.0.0.1", 9464, str)._bind()
