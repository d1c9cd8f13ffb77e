"""The ranks of a tensor-parallel vLLM engine agree on one generation before any loads it
(`wcd.integrations.vllm_transfer.agreed_lease`), against a real daemon: one client per rank, as
each worker process has, and a collective made of threads in place of vLLM's all-reduce."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from wcd.integrations.vllm_transfer import agreed_lease, take


class Collective:
    """`agree(rank)(n)` for `ranks` threads: waits for every rank's n, returns (max, min), and
    records each round's values."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=30)
        self.slots = [0] * ranks
        self.rounds: list[list[int]] = []

    def agree(self, rank: int) -> Callable[[int], tuple[int, int]]:
        def call(n: int) -> tuple[int, int]:
            self.slots[rank] = n
            self.barrier.wait()
            values = list(self.slots)
            if rank == 0:
                self.rounds.append(values)
            self.barrier.wait()  # nobody writes the next round before every rank read this one
            return max(values), min(values)

        return call


def run_ranks(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Each job in its own thread; its result or the exception it raised."""
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in the agreement"
    return results


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(1024, generator=g) for i in range(4)}


def policy_leases(client: Any) -> list[str]:
    return sorted(x["entry"] for x in client.list_leases() if x["entry"].startswith("policy@"))


def test_a_commit_between_two_ranks_asks_puts_both_on_the_newer_generation(make_daemon: Any) -> None:
    daemon = make_daemon()
    with daemon.client() as trainer, daemon.client() as rank0, daemon.client() as rank1:
        assert trainer.publish_generation("policy", weights(1)) == 1
        collective = Collective(2)
        took0, published = threading.Event(), threading.Event()

        def first_take(client: Any, before: Callable[[], None], after: Callable[[], None]) -> Any:
            asked = [False]

            def call(series: str, generation: int | None) -> Any:
                if not asked[0]:
                    before()
                got = take(client, "policy", series, generation)
                if not asked[0]:
                    asked[0] = True
                    after()
                return got

            return call

        def rank(i: int, client: Any, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], Any]:
            return lambda: agreed_lease(first_take(client, before, after), collective.agree(i), "policy", None)

        def commit() -> None:
            assert took0.wait(30)
            assert trainer.publish_generation("policy", weights(2)) == 2
            published.set()

        # rank 0 asks for the current generation (1), the trainer commits 2, rank 1 asks (2).
        leases = run_ranks([rank(0, rank0, lambda: None, took0.set),
                            rank(1, rank1, lambda: published.wait(30) or None, lambda: None), commit])[:2]
        assert not [x for x in leases if isinstance(x, Exception)], leases
        assert [x.entry for x in leases] == ["policy@2", "policy@2"]
        assert collective.rounds == [[1, 2], [2, 2]], "rank 0 saw 2 was there and took it too"
        assert policy_leases(trainer) == ["policy@2", "policy@2"], "rank 0's lease on 1 was given back"
        expected = weights(2)
        for lease in leases:
            assert all(torch.equal(lease.tensors[n], t) for n, t in expected.items())
            lease.release()
        assert policy_leases(trainer) == []


@pytest.mark.parametrize("why", ["another series", "no such generation"])
def test_when_one_rank_cannot_take_the_generation_no_rank_keeps_it(make_daemon: Any, why: str) -> None:
    daemon = make_daemon()
    with daemon.client() as trainer, daemon.client() as rank0, daemon.client() as rank1:
        assert trainer.publish_generation("policy", weights(1)) == 1
        assert trainer.publish_generation("policy", weights(2)) == 2
        collective = Collective(2)

        def rank1_take(series: str, generation: int | None) -> Any:
            if why == "another series":  # initialised for another series: refused before asking
                return take(rank1, "other", series, generation)
            return take(rank1, "policy", series, 7)  # as if generation 2 were gone when this rank asked

        results = run_ranks([
            lambda: agreed_lease(lambda s, g: take(rank0, "policy", s, g), collective.agree(0), "policy", 2),
            lambda: agreed_lease(rank1_take, collective.agree(1), "policy", 2)])
        assert all(isinstance(r, ValueError) for r in results), results
        first, second = (str(r) for r in results)
        assert first == ("wcd: another rank of this engine could not take generation 2 of 'policy', so no rank "
                         "loaded it (that rank's reason is in the server's log)")
        assert second.startswith("wcd: ") and "\n" not in second and "policy" in second, second
        assert collective.rounds == [[2, 0]], "one agreement, then both refused"
        assert policy_leases(trainer) == [], "rank 0 gave its lease back"
