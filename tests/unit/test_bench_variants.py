"""bench/common.py's variants name daemon settings and load tuning that exist: a setting renamed
or removed fails here, not in a benchmark run on the GPU machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import common  # noqa: E402

from wcd.config import load_config  # noqa: E402
from wcd.tuning import LoadTuning  # noqa: E402


@pytest.mark.parametrize("name", sorted(common.VARIANTS))
def test_a_variant_sets_only_what_the_daemon_has(name: str, tmp_path: Path) -> None:
    v = common.VARIANTS[name]
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "s"}"\n{v.config_lines()}')
    daemon = load_config(config).daemon
    for key, value in v.config.items():
        assert getattr(daemon, key) == value
    tuning = LoadTuning(**v.tuning)  # unknown fields and bad values raise
    assert all(getattr(tuning, knob) == value for knob, value in v.tuning.items())


def test_variants_combine_and_unknown_ones_are_one_line() -> None:
    both = common.variant("buffered+noahead")
    assert both.config == {"cold_reads": "buffered"} and both.tuning == {"read_ahead_bytes": 0}
    with pytest.raises(SystemExit, match="unknown variant 'nope'; known: default, "):
        common.variant("nope")
