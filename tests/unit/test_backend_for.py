"""`backend_for` on machines that cannot serve a GPU: one `device_unavailable` line saying what to
install, never a ModuleNotFoundError or an `internal` error. No GPU or cuda-bindings needed: the
missing or driverless bindings are simulated."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from unittest import mock

import pytest

import wcd.arenas
from tests.unit.fake_cuda import CUDA_MODULES, forget_cuda_modules
from wcd.arenas import backend_for, cuda_requirement, cudrv, device_memory, start_driver
from wcd.arenas.cudrv import Gpu
from wcd.errors import DeviceUnavailable


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No backend chosen yet and the CUDA arena modules not imported, so each test imports them anew
    (and the copies bound to fake bindings are gone afterwards)."""
    monkeypatch.setattr(wcd.arenas, "_backends", {})
    real = {name: sys.modules.pop(name) for name in CUDA_MODULES if name in sys.modules}
    yield
    forget_cuda_modules()
    for name in CUDA_MODULES:
        attr = name.rpartition(".")[2]
        if name in real:
            sys.modules[name] = real[name]
            setattr(wcd.arenas, attr, real[name])
        elif hasattr(wcd.arenas, attr):
            delattr(wcd.arenas, attr)


def test_the_cuda_extra_requirement_comes_from_the_installed_metadata() -> None:
    # pyproject.toml's cuda extra is the one place naming the supported cuda-bindings releases.
    assert cuda_requirement().replace(" ", "") in ("cuda-bindings<13,>=12.9.6", "cuda-bindings>=12.9.6,<13")


@pytest.mark.usefixtures("fresh")
def test_gpu_device_without_cuda_bindings_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)  # import cuda... -> ModuleNotFoundError
    with pytest.raises(DeviceUnavailable) as e:
        backend_for("cuda:0")
    assert e.value.code == "device_unavailable"
    assert "wcd-cuda package" in e.value.message and f"pip install '{cuda_requirement()}'" in e.value.message
    assert backend_for("cpu").canonical("cpu") == "cpu"  # host memory is unaffected


@pytest.mark.usefixtures("fresh")
@pytest.mark.parametrize("cu_init", [
    mock.Mock(side_effect=RuntimeError("Failed to dlopen libcuda.so.1")),  # bindings, no driver
    mock.Mock(return_value=(mock.sentinel.CUDA_ERROR_INSUFFICIENT_DRIVER,)),  # a driver too old
])
def test_gpu_device_without_a_driver_says_install_the_driver(monkeypatch: pytest.MonkeyPatch,
                                                             cu_init: mock.Mock) -> None:
    _fake_bindings(monkeypatch, cu_init)
    with pytest.raises(DeviceUnavailable, match=r"CUDA driver not (available|usable) .*install the NVIDIA driver"):
        backend_for("cuda:0").canonical("cuda:0")


def _fake_bindings(monkeypatch: pytest.MonkeyPatch, cu_init: mock.Mock) -> None:
    driver = mock.MagicMock(name="cuda.bindings.driver")
    driver.cuInit = cu_init
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver  # type: ignore[attr-defined]
    package = types.ModuleType("cuda")
    package.bindings = bindings  # type: ignore[attr-defined]
    for name, module in (("cuda", package), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, module)


def _driver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wcd-cuinit"]


class _FakeDriver:
    """Stands in for `wcd.arenas.cudrv.Driver` (ctypes, libcuda): one H200 at cuda:0."""

    loads = 0

    def __init__(self) -> None:
        type(self).loads += 1

    def gpus(self) -> tuple[Gpu, ...]:
        return (Gpu(0, "GPU-00000000-1111-2222-3333-444444444444", "NVIDIA H200"),)

    def total_memory(self, gpu: Gpu) -> int:
        return 150_000_000_000


class _NoDriver:
    def __init__(self) -> None:
        raise DeviceUnavailable("CUDA driver not available (libcuda.so.1: cannot open); install the NVIDIA driver")


@pytest.fixture
def driverless(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process-wide driver loaded yet; `Driver` is set by each test."""
    monkeypatch.setattr(cudrv, "_driver", None)


@pytest.mark.usefixtures("driverless")
def test_start_driver_loads_the_driver_in_a_thread_only_for_a_gpu_and_imports_no_cuda_bindings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudrv, "Driver", _FakeDriver)
    monkeypatch.setattr(_FakeDriver, "loads", 0)
    monkeypatch.delitem(sys.modules, "cuda.bindings", raising=False)
    start_driver(["cpu"])
    assert not _driver_threads() and _FakeDriver.loads == 0  # a host-only daemon never touches CUDA
    start_driver(["cpu", "cuda:1"])
    for t in _driver_threads():
        t.join(5)
    assert _FakeDriver.loads == 1 and "cuda.bindings" not in sys.modules
    monkeypatch.setattr(wcd.arenas, "_bindings_installed", lambda: True)
    assert device_memory("cuda:0") == ("GPU-00000000-1111-2222-3333-444444444444", 150_000_000_000)
    assert _FakeDriver.loads == 1 and "cuda.bindings" not in sys.modules  # found loaded; still not imported


@pytest.mark.usefixtures("driverless")
def test_start_driver_without_a_driver_leaves_the_error_to_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudrv, "Driver", _NoDriver)
    monkeypatch.setattr(wcd.arenas, "_bindings_installed", lambda: True)
    uncaught: list[object] = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    start_driver(["GPU-1234"])
    for t in _driver_threads():
        t.join(5)
    assert not _driver_threads() and uncaught == []  # the thread kept the error to itself
    with pytest.raises(DeviceUnavailable, match="CUDA driver not available .* install the NVIDIA driver"):
        device_memory("GPU-1234")


@pytest.mark.usefixtures("fresh", "driverless")
def test_device_memory_without_cuda_bindings_says_what_to_install_before_loading_the_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)  # import cuda... -> ModuleNotFoundError
    monkeypatch.setattr(cudrv, "Driver", _FakeDriver)
    monkeypatch.setattr(_FakeDriver, "loads", 0)
    with pytest.raises(DeviceUnavailable) as e:
        device_memory("cuda:0")
    assert "wcd-cuda package" in e.value.message and f"pip install '{cuda_requirement()}'" in e.value.message
    assert _FakeDriver.loads == 0
    assert device_memory("cpu")[0] == "cpu" and device_memory("cpu")[1] > 0  # host memory is unaffected


def test_the_daemons_start_up_imports_no_prometheus_and_no_cuda_for_a_host_config() -> None:
    """prometheus-client comes at the first scrape (or after READY); cuda-bindings only for a GPU."""
    code = ("import sys, wcd.cli.wcd, wcd.config, wcd.server; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('prometheus_client', 'cuda', 'torch')))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert loaded == []


LOAD_WITH_A_TICKER = """
import sys, threading, time
from wcd.arenas.cudrv import load_library

done, took = threading.Event(), []

def load():
    start = time.perf_counter()
    load_library(sys.argv[1])
    took.append(time.perf_counter() - start)
    done.set()

gaps, last = [], time.perf_counter()
threading.Thread(target=load).start()
while not done.is_set():
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
print(took[0], max(gaps))
"""


def test_loading_a_library_in_a_thread_leaves_the_main_thread_running() -> None:
    """The daemon loads libcuda from its start-up thread while the main thread imports; ctypes' own
    dlopen would hold the GIL throughout. Timed here with the largest library at hand, torch's CPU
    library (hundreds of MB), loaded in a fresh interpreter."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtorch_cpu.so"
    out = subprocess.run([sys.executable, "-c", LOAD_WITH_A_TICKER, str(lib)], check=True, capture_output=True,
                         text=True).stdout.split()
    took, longest_stall = float(out[0]), float(out[1])
    assert took > 0.05, f"{lib} loaded in {took:.3f} s: too fast to tell"
    assert longest_stall < took / 2, (took, longest_stall)
