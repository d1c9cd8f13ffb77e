"""Configuration: TOML loading, sizes and fractions, and one-line errors that name the field."""

from __future__ import annotations

import grp
import os
import re
from pathlib import Path

import pytest

from wcd.config import RUN_DIR, Config, instance_config_path, load_config
from wcd.configfile import named_devices, read_toml
from wcd.errors import ConfigError
from wcd.units import parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    d = tmp_path / "weights"
    d.mkdir()
    return d


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "wcd.toml"
    p.write_text(text)
    return p


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = info.value.message
    assert "\n" not in text
    assert text.startswith(f"config {path}: ")
    return text.removeprefix(f"config {path}: ")


# -- valid configs ------------------------------------------------------------------------------


def test_valid_example(tmp_path: Path, weights: Path) -> None:
    path = write(tmp_path, f"""
[daemon]
socket = "/run/wcd/llama70b.sock"
lease_ttl_s = 12.5
allowed_uids = [0, 1000]
budget = {{ cpu = "64GiB", "cuda:0" = "90%", "cuda:1" = 1000 }}
load_workers = 4

[[models]]
name = "llama70b"
path = "{weights}"
retention = "pinned"

[[models]]
name = "qwen3-8b.v2"
path = "{weights}/../weights"
device = "cuda:0"
retention = "cached"
""")
    c = load_config(path, "llama70b")
    assert c.daemon.socket == Path("/run/wcd/llama70b.sock")
    assert c.daemon.lease_ttl_s == 12.5
    assert c.daemon.allowed_uids == [0, 1000]
    assert c.daemon.budget == {"cpu": "64GiB", "cuda:0": "90%", "cuda:1": 1000}
    assert c.daemon.load_workers == 4
    assert [(m.name, m.device, m.retention) for m in c.models] == [
        ("llama70b", "cpu", "pinned"), ("qwen3-8b.v2", "cuda:0", "cached")]
    assert c.models[0].path == weights.resolve() == c.models[1].path  # resolved


def test_empty_config_has_defaults(tmp_path: Path) -> None:
    c = load_config(write(tmp_path, ""))
    assert c.models == [] and c.daemon.budget == {} and c.daemon.lease_ttl_s == 30.0
    assert c.daemon.socket == RUN_DIR / "wcd.sock"


def test_default_socket_follows_the_instance(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon]\nlease_ttl_s = 5\n")
    assert load_config(path, "one").daemon.socket == RUN_DIR / "one.sock"
    assert load_config(path, "two").daemon.socket == RUN_DIR / "two.sock"  # no state shared between loads
    assert Config().daemon.socket is None


def test_instance_config_path() -> None:
    assert instance_config_path("llama70b") == Path("/etc/wcd/llama70b.toml")


def test_shipped_example_parses(tmp_path: Path, weights: Path) -> None:
    example = REPO / "systemd" / "example.toml"
    if not example.exists():
        pytest.skip("systemd/example.toml is not in this tree")
    text = re.sub(r'(?m)^path = ".*"$', f'path = "{weights}"', example.read_text())
    c = load_config(write(tmp_path, text), "llama70b")
    assert c.models and all(m.path == weights.resolve() for m in c.models)
    for size in c.daemon.budget.values():
        parse_size(size, 1 << 40)


def test_allowed_groups_resolve_to_gids(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    c = load_config(write(tmp_path, f'[daemon]\nallowed_groups = ["{group}"]\n'))
    assert c.daemon.allowed_gids() == {os.getgid()}


# -- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (123, 123),
        ("123", 123),
        (" 10 ", 10),
        ("10B", 10),
        ("2K", 2000),
        ("2kb", 2000),
        ("500MB", 500 * 10**6),
        ("3G", 3 * 10**9),
        ("1.5 TB", 1_500_000_000_000),
        ("2T", 2 * 10**12),
        ("4KiB", 4 * 1024),
        ("512MiB", 512 * 1024**2),
        ("64GiB", 64 * 1024**3),
        ("64gib", 64 * 1024**3),
        ("0.5GiB", 512 * 1024**2),
        ("1TiB", 1024**4),
    ],
)
def test_parse_size_units(value: int | str, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    ("value", "total", "expected"),
    [("90%", 1000, 900), ("100%", 1000, 1000), ("50 %", 4096, 2048), ("12.5%", 800, 100), (" 1% ", 10**12, 10**10),
     ("90%", None, -1)],
)
def test_parse_size_fractions(value: str, total: int | None, expected: int) -> None:
    assert parse_size(value, total) == expected


@pytest.mark.parametrize(
    "value",
    ["", "lots", "64 GiBs", "1e3", "0x10", "-5", "5 PB", "1.2.3G", "%", "abc%", "0%", "-10%", "101%", "nan%",
     -1, 1.5, True, None, [64]],
)
def test_parse_size_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value, 1000)  # type: ignore[arg-type]


# -- errors -------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    assert config_error(path) == "file not found"


def test_unreadable_file(tmp_path: Path) -> None:
    assert config_error(tmp_path).startswith("cannot read (")  # a directory


def test_bad_toml(tmp_path: Path) -> None:
    assert config_error(write(tmp_path, "[daemon\nlease_ttl_s = 1\n")).startswith("not valid TOML (")


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "wcd.toml"
    path.write_bytes(b"[daemon]\nlease_ttl_s = 1 # \xff\xfe\n")
    assert config_error(path) == "not valid TOML (not UTF-8 text)"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[[models]]\nname = "a"\npath = "/x"\ndevice = "cuda:1"\n[daemon.budget]\n"GPU-1234" = "10GiB"\ncpu = 1',
         ["cuda:1", "GPU-1234", "cpu"]),
        ('[[models]]\nname = "a"\npath = "/x"', []),  # the default device is named nowhere
        ("models = 3\ndaemon = 4", []),
        ('models = [1, {device = 2}, {device = "cuda:0"}]\n[daemon]\nbudget = ["cuda:2"]', ["cuda:0"]),
    ],
)
def test_the_devices_a_file_names_before_it_is_validated(tmp_path: Path, text: str, named: list[str]) -> None:
    """`wcd serve` starts the CUDA driver from these before the schemas import; malformed parts
    name nothing (validation reports them)."""
    assert named_devices(read_toml(write(tmp_path, text))) == named


@pytest.mark.parametrize(
    ("text", "where", "why"),
    [
        ('[daemon]\nlease_ttl_s = "soon"', "daemon.lease_ttl_s", "valid number"),
        ("[daemon]\nlease_ttl_s = 0", "daemon.lease_ttl_s", "greater than"),
        ("[daemon]\nlease_ttl_s = 7200", "daemon.lease_ttl_s", "less than"),
        ("[daemon]\nallowed_uids = [-1]", "daemon.allowed_uids.0", "greater than or equal to 0"),
        ('[daemon]\nallowed_uids = "root"', "daemon.allowed_uids", "valid list"),
        ("[daemon]\nload_workers = 0", "daemon.load_workers", "greater than"),
        ("[daemon]\nmax_connections = 1.5", "daemon.max_connections", "integer"),
        ("daemon = 5", "daemon", "valid dictionary"),
        ('[models]\nname = "a"', "models", "valid list"),
        ('[[models]]\nname = "a"\npath = "{w}"\nretention = "forever"', "models.0.retention", "'pinned'"),
        ('[[models]]\nname = "-a"\npath = "{w}"', "models.0.name", "pattern"),
        ('[[models]]\nname = "a"\npath = "{w}"\ndevice = 0', "models.0.device", "valid string"),
    ],
)
def test_wrong_types(tmp_path: Path, weights: Path, text: str, where: str, why: str) -> None:
    text = config_error(write(tmp_path, text.replace("{w}", str(weights))))
    assert text.startswith(f"{where}: ") and why in text


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("colour = 1", "colour"),
        ("[daemon]\nlease_ttl = 5", "daemon.lease_ttl"),
        ('[[models]]\nname = "a"\npath = "{w}"\npinned = true', "models.0.pinned"),
        ('[[models]]\nname = "a"\npath = "{w}"\n[[models]]\nname = "b"\npath = "{w}"\nsize = 1', "models.1.size"),
    ],
)
def test_unknown_keys(tmp_path: Path, weights: Path, text: str, where: str) -> None:
    assert config_error(write(tmp_path, text.replace("{w}", str(weights)))) == f"{where}: unknown key"


def test_missing_model_path(tmp_path: Path) -> None:
    assert config_error(write(tmp_path, '[[models]]\nname = "a"\n')) == "models.0.path: Field required"


def test_missing_model_name(tmp_path: Path, weights: Path) -> None:
    assert config_error(write(tmp_path, f'[[models]]\npath = "{weights}"\n')) == "models.0.name: Field required"


def test_model_path_that_does_not_exist(tmp_path: Path, weights: Path) -> None:
    text = f'[[models]]\nname = "a"\npath = "{weights}"\n[[models]]\nname = "b"\npath = "{tmp_path}/gone"\n'
    assert config_error(write(tmp_path, text)) == f"models.1.path: {tmp_path}/gone does not exist"


def test_duplicate_model_names(tmp_path: Path, weights: Path) -> None:
    text = "".join(f'[[models]]\nname = "{n}"\npath = "{weights}"\n' for n in ["a", "b", "a", "c", "b"])
    assert "model names must be unique; repeated: a, b" in config_error(write(tmp_path, text))


def test_duplicate_model_names_name_the_field(tmp_path: Path, weights: Path) -> None:
    text = "".join(f'[[models]]\nname = "{n}"\npath = "{weights}"\n' for n in ["a", "a"])
    assert re.match(r"models(\.1\.name)?: ", config_error(write(tmp_path, text)))


def test_unknown_group(tmp_path: Path) -> None:
    text = config_error(write(tmp_path, '[daemon]\nallowed_groups = ["no-such-group-wcd-test"]\n'))
    assert text == "daemon.allowed_groups: group 'no-such-group-wcd-test' does not exist on this host"


@pytest.mark.parametrize(
    ("budget", "why"),
    [
        ('"lots"', "cannot read size 'lots'"),
        ('"64 GiBs"', "cannot read size"),
        ("-1", "must not be negative"),
        ('"0%"', "must be in (0%, 100%]"),
        ('"150%"', "must be in (0%, 100%]"),
        ('"abc%"', "abc"),
    ],
)
def test_bad_size(tmp_path: Path, budget: str, why: str) -> None:
    text = config_error(write(tmp_path, f"[daemon]\nbudget = {{ cpu = {budget} }}\n"))
    assert text.startswith("daemon.budget") and "cpu" in text and why in text


def test_bad_size_type(tmp_path: Path) -> None:
    assert config_error(write(tmp_path, "[daemon]\nbudget = { cpu = [1] }\n")).startswith("daemon.budget.cpu")


def test_boolean_budget_is_refused(tmp_path: Path) -> None:
    assert config_error(write(tmp_path, "[daemon]\nbudget = { cpu = true }\n")).startswith("daemon.budget")
