"""Generations of a series against a real daemon: publish, follow in place and by copy, rollback,
the layout and publisher rules, the budget, and what a dead trainer or engine leaves behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from wcd.errors import BadRequest, NotFound, OutOfMemory, PermissionDenied, WcdError


def weights(seed: int, n: int = 8, numel: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(n)}
    out["embed"] = torch.randint(0, 1 << 30, (numel // 2,), generator=g, dtype=torch.int64)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's bytes, in name order: equal exactly when the bytes are."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].resolve_conj().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def make_daemon(make_daemon: Any) -> Iterator[Any]:
    """The integration daemon, whose `client()`s are closed when the test ends."""
    opened: list[Any] = []

    def make(*args: Any, **kwargs: Any) -> Any:
        daemon = make_daemon(*args, **kwargs)
        plain = daemon.client

        def client(**kw: Any) -> Any:
            opened.append(plain(**kw))
            return opened[-1]

        daemon.client = client
        return daemon

    yield make
    for c in opened:
        c.close()


def entries(client: Any) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in client.list()}


def test_a_follower_moves_to_each_generation_in_place_and_back_on_rollback(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client()
    assert trainer.publish_generation("policy", weights(1)) == 1
    follower = engine.follow("policy")
    views = follower.tensors
    addresses = {n: t.data_ptr() for n, t in views.items()}
    assert digest(views) == digest(weights(1)) and follower.generation == 1

    assert trainer.publish_generation("policy", weights(2)) == 2
    assert follower.poll(timeout=10) == 2  # told over its own connection
    waited: list[str] = []
    plain = engine.request_fds
    engine.request_fds = lambda op, **kw: (waited.append(op), plain(op, **kw))[1]
    assert follower.update() is True and follower.generation == 2
    assert waited == ["acquire"], "one round trip: the old lease ends without waiting for the answer"
    assert digest(views) == digest(weights(2)), "the same tensor objects read generation 2"
    assert {n: t.data_ptr() for n, t in follower.tensors.items()} == addresses

    engine.ping()  # the release before it is done once the ping is answered
    listed = entries(trainer)
    assert listed["policy@2"]["current"] and listed["policy@1"]["state"] == "previous"
    assert listed["policy@1"]["leases"] == 0 and listed["policy@2"]["leases"] == 1

    reply = trainer.rollback("policy")
    assert reply["generation"] == 1 and reply["told"] == 1
    assert follower.poll(timeout=10) == 1 and follower.update() is True
    assert digest(views) == digest(weights(1)) and follower.generation == 1
    assert follower.update() is False  # already current
    follower.close()


def test_a_copy_in_follower_copies_each_generation_into_its_own_tensors(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client()
    trainer.publish_generation("policy", weights(1))
    owned = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    follower = engine.follow("policy", copy_into=owned)
    assert follower.tensors is not None and digest(owned) == digest(weights(1))
    assert follower.lease is None and entries(trainer)["policy@1"]["leases"] == 0  # holds nothing between updates
    trainer.publish_generation("policy", weights(2))
    assert follower.update() and digest(owned) == digest(weights(2))
    follower.close()


def test_old_generations_go_when_no_longer_kept_nor_leased(make_daemon: Any) -> None:
    daemon = make_daemon("keep_generations = 1\n")
    trainer, engine = daemon.client(), daemon.client()
    trainer.publish_generation("p", weights(1))
    pinned_on_1 = engine.follow("p")  # stays on generation 1
    trainer.publish_generation("p", weights(2))
    trainer.publish_generation("p", weights(3))
    listed = entries(trainer)
    assert listed["p@1"]["state"] == "evicting", "past keep_generations, it waits for its reader"
    assert listed["p@2"]["state"] == "previous" and listed["p@3"]["current"]
    assert digest(pinned_on_1.tensors) == digest(weights(1)), "a reader keeps its generation"
    pinned_on_1.close()
    deadline = time.monotonic() + 5
    while "p@1" in entries(trainer) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "p@1" not in entries(trainer), "reclaimed when its last lease ended"
    with pytest.raises(NotFound, match="kept"):
        trainer.rollback("p", 1)


def test_a_generation_must_keep_the_layout_of_its_series(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer = daemon.client()
    trainer.publish_generation("p", weights(1))
    with pytest.raises(BadRequest, match="another layout"):
        trainer.publish_generation("p", weights(2, n=9))
    other = dict(weights(2))
    other["embed"] = other["embed"].to(torch.int32)
    with pytest.raises(BadRequest, match="another layout"):
        trainer.publish_generation("p", other)
    assert entries(trainer)["p@1"]["current"] and len(entries(trainer)) == 1, "a refused generation changes nothing"


@pytest.mark.skipif(os.geteuid() != 0, reason="a peer of another uid needs root")
def test_only_the_series_publisher_publishes_or_rolls_back_its_generations(make_daemon: Any) -> None:
    shared = Path(tempfile.mkdtemp(prefix="wcd-gen-", dir="/tmp"))
    shared.chmod(0o1777)
    try:
        daemon = make_daemon("allowed_uids = [1001]\n", socket=shared / "wcd.sock")
        trainer = daemon.client()
        trainer.publish_generation("p", weights(1))
        trainer.publish_generation("p", weights(2))
        code = textwrap.dedent(f"""
            import os, torch
            import wcd.client, wcd.views, wcd.key
            from wcd.client import Client
            from wcd.errors import WcdError
            os.setgroups([])
            os.setuid(1001)
            c = Client({str(daemon.socket)!r})
            for what, call in (("publish", lambda: c.publish_generation("p", {{"x": torch.zeros(4)}})),
                               ("rollback", lambda: c.rollback("p"))):
                try:
                    call()
                    print(what, "ok")
                except WcdError as e:
                    print(what, e.code, e.message)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "publish permission_denied series 'p' is published by uid 0" in out.stdout, out.stdout + out.stderr
        assert "rollback permission_denied" in out.stdout
        assert entries(trainer)["p@2"]["current"]
    finally:
        shutil.rmtree(shared)


def test_a_generation_that_cannot_fit_beside_the_current_one_is_refused_in_one_line(make_daemon: Any) -> None:
    daemon = make_daemon('budget = { cpu = "1MiB" }\n')
    trainer, engine = daemon.client(), daemon.client()
    big = {"w": torch.zeros(160_000)}  # 640 kB: one fits, two do not
    trainer.publish_generation("p", big)
    follower = engine.follow("p")
    with pytest.raises(OutOfMemory, match="does not fit"):
        trainer.publish_generation("p", {"w": torch.ones(160_000)})
    assert follower.update() is False and entries(trainer)["p@1"]["current"]


@pytest.mark.slow  # a second interpreter importing torch: seconds on 2 cores
def test_a_trainer_killed_mid_reserve_leaves_the_series_on_its_generation(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client()
    trainer.publish_generation("p", weights(1))
    follower = engine.follow("p")
    code = textwrap.dedent(f"""
        import os, torch
        from wcd.client import Client
        from wcd.key import WeightCacheKey
        c = Client({str(daemon.socket)!r})
        shapes = dict(("layers.%d.w" % i, (torch.float32, (4096,))) for i in range(8))
        shapes["embed"] = (torch.int64, (2048,))
        fill = c.reserve(WeightCacheKey(model="p", transform="generations"), shapes, series="p")
        fill.tensors["embed"].fill_(7)
        print("reserved", flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "reserved" in out.stdout, out.stderr
    deadline = time.monotonic() + 10
    while "p@2" in entries(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(entries(trainer)) == {"p@1"}, "the half-filled generation went with its trainer"
    assert follower.update() is False and digest(follower.tensors) == digest(weights(1))
    assert trainer.publish_generation("p", weights(3)) == 2, "the next generation takes the number"
    assert follower.update() and digest(follower.tensors) == digest(weights(3))


@pytest.mark.slow  # a second interpreter importing torch: seconds on 2 cores
def test_an_engine_killed_mid_follow_returns_its_generation(make_daemon: Any) -> None:
    daemon = make_daemon("keep_generations = 0\n")
    trainer = daemon.client()
    trainer.publish_generation("p", weights(1))
    code = textwrap.dedent(f"""
        import os
        from wcd.client import Client
        f = Client({str(daemon.socket)!r}).follow("p")
        print("following", f.generation, flush=True)
        f.poll(timeout=30)
        os.kill(os.getpid(), 9)  # told of generation 2, killed before (or while) moving to it
    """)
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as engine:
        assert engine.stdout is not None and engine.stdout.readline().startswith("following 1")
        assert entries(trainer)["p@1"]["leases"] == 1
        trainer.publish_generation("p", weights(2))
        engine.wait(timeout=30)
    deadline = time.monotonic() + 10
    while "p@1" in entries(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(entries(trainer)) == {"p@2"}, "keep_generations = 0: generation 1 went with its last reader"


def test_watch_and_series_errors_are_one_line(make_daemon: Any) -> None:
    daemon = make_daemon("max_watches_per_connection = 2\n")
    c = daemon.client()
    with pytest.raises(NotFound, match="no series named 'nope'"):
        c.follow("nope")
    c.watch("a")
    c.watch("b")
    with pytest.raises(WcdError, match="max_watches_per_connection"):
        c.watch("c")
    with pytest.raises(BadRequest, match="series"):
        c.request("acquire", series="a@1")
    from wcd.key import WeightCacheKey

    with pytest.raises(PermissionDenied, match="reserved"):  # a raw checkpoint's transform, as any publish
        c.reserve(WeightCacheKey(model="x"), {"x": (torch.float32, (4,))}, series="p")


def test_wcdctl_lists_generations_and_rolls_a_series_back(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer = daemon.client()
    trainer.publish_generation("policy", weights(1))
    trainer.publish_generation("policy", weights(2))
    wcdctl = [str(Path(sys.executable).parent / "wcdctl"), "--socket", str(daemon.socket)]
    if not Path(wcdctl[0]).exists():
        wcdctl = [sys.executable, "-m", "wcd.cli.wcdctl", "--socket", str(daemon.socket)]
    listed = subprocess.run([*wcdctl, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "policy@1" in listed.stdout and "previous" in listed.stdout, listed
    out = subprocess.run([*wcdctl, "rollback", "policy"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "policy: generation 1 is current again (policy@1; 0 followers told)"
    again = subprocess.run([*wcdctl, "rollback", "policy", "--to", "7"], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "generation 7 is not kept" in again.stderr


@pytest.mark.slow
def test_commits_announced_to_many_watchers_that_never_read_leave_other_clients_fast(make_daemon: Any) -> None:
    """The hook's question for `watch`: 500 connections watching one series (and never reading
    their events) while a trainer commits 20 generations; a second client's pings stay fast, and
    the watchers' unread events stay within their connections' buffers."""
    from tests.integration.pings import assert_fast, pinging
    from wcd.client import Client

    daemon = make_daemon("max_connections = 1024\nmax_connections_per_uid = 1024\n")
    trainer = daemon.client()
    trainer.publish_generation("s", weights(1, n=2, numel=256))
    watchers = []
    for _ in range(500):
        c = Client(daemon.socket, heartbeats=False)
        c.watch("s")
        watchers.append(c)
    try:
        with pinging(daemon) as pings:
            for seed in range(2, 22):
                trainer.publish_generation("s", weights(seed, n=2, numel=256))
        assert_fast(pings)
        [series] = trainer.status()["series"]
        assert series["watchers"] == 500 and series["current"] == 21
        follower = watchers[0].follow("s")  # a watcher that reads later finds every announcement queued
        assert follower.generation == 21 and follower.poll(timeout=0) == 21
        follower.close()
    finally:
        for c in watchers:
            c.close()


def test_a_follower_is_told_again_after_the_daemon_restarts(make_daemon: Any) -> None:
    """Watches belong to a connection: the client asks again when it reconnects."""
    daemon = make_daemon()
    engine = daemon.client()
    engine.watch("s")
    assert daemon.stop() == 0
    daemon.start()
    trainer = daemon.client()
    engine.ping()  # reconnects (it held no lease) and watches again
    trainer.publish_generation("s", weights(1))
    event = engine.next_event(timeout=10)
    assert event is not None and event["series"] == "s" and event["generation"] == 1


def test_a_plain_publish_cannot_pose_as_a_generation(make_daemon: Any) -> None:
    from wcd.key import WeightCacheKey

    daemon = make_daemon()
    c = daemon.client()
    with pytest.raises(BadRequest, match="reserve with 'series'"):
        c.publish(WeightCacheKey(model="x", transform="t", extra={"series": "s", "generation": "9"}),
                  {"w": torch.zeros(4)})
    assert entries(c) == {}


def test_a_poll_between_steps_sees_a_commit_and_followers_share_one_connection(make_daemon: Any) -> None:
    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client(heartbeats=False)
    trainer.publish_generation("s", weights(1))
    trainer.publish_generation("t", weights(1))
    fs, ft = engine.follow("s"), engine.follow("t")
    trainer.publish_generation("t", weights(2))
    trainer.publish_generation("s", weights(3))
    deadline = time.monotonic() + 5
    while fs.poll() != 2 and time.monotonic() < deadline:  # timeout 0: no request of its own meanwhile
        time.sleep(0.01)
    assert fs.poll() == 2 and ft.poll() == 2, "each follower sees its series, whoever read the event"
    assert fs.update() and ft.update()
    assert digest(fs.tensors) == digest(weights(3)) and digest(ft.tensors) == digest(weights(2))


@pytest.mark.skipif(os.geteuid() != 0, reason="a peer of another uid needs root")
def test_a_follower_refuses_a_generation_from_another_publisher(make_daemon: Any) -> None:
    """The squat: uid 1001 pushes the followed series out (budget pressure), publishes its own
    generations under the same name and layout; the follower refuses them and keeps its bytes."""
    shared = Path(tempfile.mkdtemp(prefix="wcd-gen-", dir="/tmp"))
    shared.chmod(0o1777)
    try:
        daemon = make_daemon('allowed_uids = [1001]\nbudget = { cpu = "1MiB" }\n', socket=shared / "wcd.sock")
        trainer, engine = daemon.client(), daemon.client()
        mine = {f"l{i}": torch.full((1024,), float(i)) for i in range(4)}
        trainer.publish_generation("policy", mine)
        owned = {k: torch.zeros_like(v) for k, v in mine.items()}
        follower = engine.follow("policy", copy_into=owned)
        code = textwrap.dedent(f"""
            import os, torch
            import wcd.client, wcd.views, wcd.key
            from wcd.client import Client
            from wcd.key import WeightCacheKey
            os.setgroups([])
            os.setuid(1001)
            c = Client({str(daemon.socket)!r})
            big = c.reserve(WeightCacheKey(model="filler", transform="t"), {{"x": ("U8", (1024 * 1024 - 8192,))}})
            big.abort()
            evil = {{f"l{{i}}": torch.full((1024,), 666.0) for i in range(4)}}
            print("published", c.publish_generation("policy", evil), c.publish_generation("policy", evil))
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "published 1 2" in out.stdout, out.stdout + out.stderr
        with pytest.raises(PermissionDenied, match="published by uid 1001"):
            follower.update()
        assert digest(owned) == digest(mine), "the follower kept the bytes of the publisher it followed"
    finally:
        shutil.rmtree(shared)


def test_a_trainer_publishes_host_tensors_without_mapping_the_arena(make_daemon: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors reach a host arena through its descriptor: the trainer never maps it, so its
    commit has no page tables to tear down before the seal, and readers get exactly its bytes
    (non-contiguous and conjugated sources included)."""
    import wcd.views

    maps: list[bool] = []
    real = wcd.views.map_arena
    monkeypatch.setattr(wcd.views, "map_arena", lambda arena, fd, m, writable, **kw: (
        maps.append(writable), real(arena, fd, m, writable, **kw))[1])
    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client()
    sent = weights(3)
    sent["strided"] = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    sent["complex"] = torch.randn(4, dtype=torch.complex64).conj()
    sent["empty"] = torch.empty(0, 3)
    assert trainer.publish_generation("policy", sent) == 1
    assert maps == []  # nothing mapped on the trainer's side
    follower = engine.follow("policy")
    assert digest(follower.tensors) == digest(sent)
    follower.close()


def test_a_fill_written_with_a_wrong_tensor_says_so_and_publishes_nothing(make_daemon: Any) -> None:
    from wcd.key import WeightCacheKey

    daemon = make_daemon()
    trainer = daemon.client()
    key = WeightCacheKey(model="policy", transform="generations", device="cpu")
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in weights(1).items()}
    for wrong, said in [({"layers.0.w": torch.zeros(4095)}, "reserved as torch.float32 (4096,)"),
                        ({"layers.0.w": torch.zeros(4096, dtype=torch.float64)}, "is torch.float64"),
                        ({"nope": torch.zeros(1)}, "'nope' is not one of the reserved tensors")]:
        for mapped in (False, True):
            fill = trainer.reserve(key, layout, series="policy", mapped=mapped)
            with pytest.raises(BadRequest, match="reserved") as e:
                fill.write(wrong)
            assert said in e.value.message and "\n" not in e.value.message
            fill.abort()
    assert "policy@1" not in entries(trainer)
    fill = trainer.reserve(key, layout, series="policy", mapped=False)
    fill.tensors["embed"].fill_(7)  # asked for, the views are mapped then
    fill.write({n: t for n, t in weights(1).items() if n != "embed"})  # through them
    assert fill.commit() == "policy@1"
    with trainer.acquire("policy@1") as lease:
        assert int(lease.tensors["embed"][0]) == 7
        assert torch.equal(lease.tensors["layers.1.w"], weights(1)["layers.1.w"])


def test_a_request_not_waited_for_leaves_nothing_behind_even_when_refused(make_daemon: Any) -> None:
    daemon = make_daemon()
    client = daemon.client()
    client.send_unawaited("release", lease=987654)  # no such lease: an error reply, dropped
    client.ping()
    assert not client._replies and not client._unawaited


def test_a_host_copy_in_follower_reads_each_generation_without_mapping_it(make_daemon: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Contiguous CPU tensors of a host series are filled from each generation's memfd (pread):
    the update maps nothing (no page of the arena faults in, none is torn down) and its bytes are
    exactly the generation's, forward and on rollback."""
    import wcd.views

    daemon = make_daemon()
    trainer, engine = daemon.client(), daemon.client()
    trainer.publish_generation("policy", weights(1))
    owned = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    follower = engine.follow("policy", copy_into=owned)
    maps: list[bool] = []
    real = wcd.views.map_arena
    monkeypatch.setattr(wcd.views, "map_arena", lambda arena, fd, m, writable, **kw: (
        maps.append(writable), real(arena, fd, m, writable, **kw))[1])
    trainer.publish_generation("policy", weights(2))
    assert follower.update() and digest(owned) == digest(weights(2)) and follower.generation == 2
    trainer.rollback("policy")
    assert follower.update() and digest(owned) == digest(weights(1)) and follower.generation == 1
    assert maps == []
    engine.ping()
    assert all(e["leases"] == 0 for e in entries(trainer).values())  # holds nothing between updates
    follower.close()
