"""bench/common.py's variants name daemon settings and load tuning that exist: a setting renamed
or removed fails here, not in a benchmark run on the GPU machine."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import common  # noqa: E402

from wcd.config import load_config  # noqa: E402


@pytest.mark.parametrize("name", sorted(common.VARIANTS))
def test_a_variant_sets_only_what_the_daemon_has(name: str, tmp_path: Path) -> None:
    v = common.VARIANTS[name]
    config = tmp_path / "wcd.toml"
    config.write_text(f'[daemon]\nsocket = "{tmp_path / "s"}"\n{v.config_lines()}')
    daemon = load_config(config).daemon
    for key, value in v.config.items():
        assert getattr(daemon, key) == value
    for knob in v.tuning:  # read, not imported: wcd.arenas.cuda needs cuda-bindings
        module, _, attr = common._TUNING[knob].rpartition(".")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        tree = ast.parse(Path(spec.origin).read_text())
        assert any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attr for t in node.targets)
                   for node in tree.body), common._TUNING[knob]


def test_variants_combine_and_unknown_ones_are_one_line() -> None:
    both = common.variant("buffered+noahead")
    assert both.config == {"cold_reads": "buffered"} and both.tuning == {"read_ahead_bytes": 0}
    with pytest.raises(SystemExit, match="unknown variant 'nope'; known: default, "):
        common.variant("nope")
