"""wcdctl's rendering of replies, without a daemon."""

from __future__ import annotations

from wcd.cli.wcdctl import _render


def verify_reply(names: list[str], count: int | None) -> dict[str, object]:
    r: dict[str, object] = {"entry": "m", "match": not names, "mismatched": names, "tensors": 70,
                            "against": "/ckpt", "digest": "ab"}
    if count is not None:
        r["mismatched_count"] = count
    return r


def test_verify_counts_every_mismatched_tensor_though_it_lists_fifty() -> None:
    names = [f"t{i}" for i in range(50)]
    line = _render("verify", verify_reply(names, 64))
    assert line.startswith("m: MISMATCH in 64 tensor(s): t0, t1, ") and ", t49 and 14 more (70 tensors" in line


def test_verify_lines_for_a_match_a_short_list_and_an_older_daemon() -> None:
    assert _render("verify", verify_reply([], 0)).startswith("m: OK (70 tensors against /ckpt; digest ab)")
    assert "MISMATCH in 2 tensor(s): a, b (70" in _render("verify", verify_reply(["a", "b"], 2))
    assert "MISMATCH in 2 tensor(s): a, b (70" in _render("verify", verify_reply(["a", "b"], None))
