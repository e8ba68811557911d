"""Fixtures shared by kiln's test modules."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Under pytest-xdist (-n N) each worker is one of N processes sharing the cores: one intra-op
# thread each, and for what it starts (kiln train subprocesses read OMP_NUM_THREADS), instead of
# N processes each running a thread per core and waiting on each other's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# run_distributed's workers are forked from a server that imported torch and kiln's trainer once
# (kiln.launch.testing): a call starts its workers in ~0.1 s instead of ~5 s of two new
# interpreters importing torch; each is still a fresh process with the caller's environment.
os.environ.setdefault("KILN_START_METHOD", "forkserver")

# ... and that server imports once, too, what the ranks of many tests would each import on first
# use: torch._dynamo (DTensor's distribute_tensor and FSDP2 import it), the parallel APIs,
# hydra's override parser and the transformers models the tests train (a rank unpickling a test
# module's function imports the module, and so transformers). Each was 1-3 s of CPU in every
# rank that needed it: a profile of the suite found ~300 s of imports in forked ranks. Whichever
# of run_distributed and an in-process kiln train --nproc starts a test process's server first,
# it preloads these.
RANK_PRELOAD = ["torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
                "torch.distributed.checkpoint", "hydra", "omegaconf", "kiln.hf", "transformers",
                *(f"transformers.models.{family}.modeling_{family}" for family in ("llama", "gpt2", "bert", "qwen2"))]


def _extend_rank_preload() -> None:
    from kiln.launch import testing
    import kiln.launch as launch

    for preload in (testing.FORKSERVER_PRELOAD, launch.WORKER_PRELOAD):
        # before kiln.launch._gc_freeze, which freezes what came before it; a missing one the server skips
        preload[-1:-1] = [m for m in RANK_PRELOAD if m not in preload]


_extend_rank_preload()

# What kiln caches about the machine (train.precision=auto's timings, the CPU's matmul peak) goes
# to a folder of this test session, not the user's ~/.cache/kiln; subprocesses inherit it.
if "KILN_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-cache-")


# ------------------------------------------------------------------------------- the test tiers
# A test says what it is: `distributed` (it starts processes that meet on gloo: run_distributed,
# kiln train --nproc N, torchrun) or `e2e` (a long end-to-end run in one process: whole trainings,
# kill -9 and signals, benchmarks' quick runs). Either makes it `slow`, which only means "not in
# the fast tier": pytest -m "not slow" is the fast tier, -m distributed or -m e2e one half of the
# rest. (pyproject.toml registers the markers; CONTRIBUTING.md names the tiers.)
SLOW_KINDS = ("distributed", "e2e")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------------------ fresh interpreters
# Tests of what an import pulls in need an interpreter that has imported nothing of kiln. Each
# such test started its own (python -c), and every one of those spent 3 s of CPU importing
# torch before the import under test. fresh_python forks them instead from one server process
# that has imported torch alone, which each of those imports begins with (import kiln.X
# imports torch first): the child's sys.modules is a new interpreter's after `import torch`.
_FORK_SERVER = r"""
import json, os, sys, traceback
import torch
for line in sys.stdin:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        try:
            exec(compile(json.loads(line), "<fresh_python>", "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    print(json.dumps([out, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]), flush=True)
"""


@pytest.fixture(scope="session")
def fresh_python():
    """``fresh_python(code) -> stdout``: run ``code`` as ``python -c code`` would, in a forked
    interpreter that has imported torch and nothing else (not kiln); a failure fails the test."""
    import json

    server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)

    def run(code: str) -> str:
        server.stdin.write(json.dumps(code) + "\n")
        server.stdin.flush()
        out, status = json.loads(server.stdout.readline())
        assert status == 0, f"fresh_python exited {status} (its traceback is on stderr); stdout: {out}"
        return out

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on tiny tensors on a shared 2-core machine, every op
    with two threads can wait a scheduler tick."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def kill_9_at():
    """``kill_9_at(args, out, checkpoint) -> run directory``: start ``kiln train *args`` as a
    process of its own (tests/launched.py ``KilnProcess``; ``args``: the config, then overrides)
    writing under ``out`` and SIGKILL it the moment
    ``checkpoints/<checkpoint>`` is complete (it appears by a rename), as a crashed machine
    would; the run must not end before that. It trains in fp32 unless ``args`` names a
    ``train.precision``: compare it with an uninterrupted run pinned the same way."""

    from launched import KilnProcess

    def run(args: list[str], out: Path, checkpoint: str, timeout: float = 120) -> Path:
        config, *overrides = map(str, args)
        # fp32 before the caller's overrides, so that one of theirs wins: train.precision=auto
        # would be bf16-mixed on a CPU with native bf16
        proc = KilnProcess(["train", config, "train.precision=fp32", *overrides, f"train.output_dir={out}"])
        deadline = time.monotonic() + timeout
        while not list(Path(out).glob(f"*/checkpoints/{checkpoint}")):
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"no {checkpoint} within {timeout} s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        (run_dir,) = Path(out).iterdir()
        assert not (run_dir / "checkpoints" / "final").exists()  # killed mid-run
        return run_dir

    return run


@pytest.fixture
def disk_full_at(monkeypatch):
    """``disk_full_at(checkpoint, code=errno.ENOSPC)``: DCP's file writer fails with ``code``
    (ENOSPC, EDQUOT) inside checkpoint ``checkpoint``, in whichever thread writes it: what a full
    disk does to a real save (a write() error naming no file). ``monkeypatch.undo()`` frees the
    space."""
    import torch.distributed.checkpoint.filesystem as fs

    write_item = fs._write_item

    def full(checkpoint: str, code: int = errno.ENOSPC) -> None:
        def failing(transforms, stream, *args, **kwargs):
            if f"/{checkpoint}.tmp/" in str(getattr(stream, "name", "")):
                raise OSError(code, os.strerror(code))
            return write_item(transforms, stream, *args, **kwargs)

        monkeypatch.setattr(fs, "_write_item", failing)

    return full


# ----------------------------------------------------------------------------- the device tier
# Tests marked gpu (pytest -m gpu; tests/test_devices.py) run on every device present: CPU always,
# CUDA where torch sees a GPU. Without CUDA every CUDA case skips with the reason below, and
# pytest_runtest_makereport gives those skips this one place, so that pytest's -ra summary shows
# them all as one line (SKIPPED [N] tests/conftest.py:L: no CUDA device here ...), never silently.

NO_CUDA = (f"no CUDA device here (torch {torch.__version__}{', a CPU build' if torch.version.cuda is None else ''}): "
           "the device tier's CUDA cases are skipped, its CPU cases ran")
_NO_CUDA_AT = (__file__, sys._getframe().f_lineno - 2)  # NO_CUDA's file and line, as -ra shows them


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and NO_CUDA in str(report.longrepr[2]):
        report.longrepr = (*_NO_CUDA_AT, report.longrepr[2])


def need_cuda(count: int = 1) -> None:
    """Skip the test unless ``count`` CUDA devices are present."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA devices, {torch.cuda.device_count()} here")


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> torch.device:
    """Each device present: the test runs once on CPU and once on CUDA (skipped without one)."""
    if request.param == "cuda":
        need_cuda()
    return torch.device(request.param)


@pytest.fixture
def cuda() -> torch.device:
    """A test of CUDA alone (a checkpoint moving between CUDA and CPU)."""
    need_cuda()
    return torch.device("cuda")


@pytest.fixture
def two_gpus() -> int:
    """A test that needs two GPUs (NCCL data parallel, ZeRO, FSDP2)."""
    need_cuda(2)
    return 2


# --------------------------------------------------------- CI's second pass: who asks about bf16
# CI runs the fast tier a second time with KILN_BF16 set the other way (.ci/run), for the tests
# whose outcome depends on whether this CPU computes bf16 natively. Only a test that asks kiln
# (kiln.hardware.bf16_override: under every cpu_capability(), train.precision=auto, the run's
# machine line) can end otherwise, as KILN_BF16 changes nothing but kiln's answer. Each pass
# records who asked into .pytest_cache/kiln-bf16/: the test, or its whole module where the
# question came while the module was collected or a fixture set up (other tests share both), or
# where the test started a process (which may ask where this process cannot see). With
# --bf16-askers only those run: ~130 s of CI's 2-core machine was the whole tier again.
import kiln.hardware as _hardware  # noqa: E402

_ASKED: set[str] = set()
_COLLECTING: list[str] = []


def _asked() -> None:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current.endswith(" (call)"):
        _ASKED.add(current[: -len(" (call)")])
    elif current:
        _ASKED.add(current.split("::", 1)[0])
    elif _COLLECTING:
        _ASKED.add(_COLLECTING[-1])


def _recording(function):
    def recorded(*args, **kwargs):
        _asked()
        return function(*args, **kwargs)

    return recorded


_hardware.bf16_override = _recording(_hardware.bf16_override)
subprocess.Popen.__init__ = _recording(subprocess.Popen.__init__)
import multiprocessing.process  # noqa: E402

multiprocessing.process.BaseProcess.start = _recording(multiprocessing.process.BaseProcess.start)


@pytest.hookimpl(hookwrapper=True)
def pytest_pycollect_makemodule(module_path, parent):
    _COLLECTING.append(str(module_path.relative_to(parent.config.rootpath)))
    try:
        yield
    finally:
        _COLLECTING.pop()


def pytest_addoption(parser):
    parser.addoption("--bf16-askers", action="store_true",
                     help="run only the tests that asked kiln about the CPU's bf16 in the last run (CI's second pass)")
    parser.addoption("--cpu-times", metavar="FILE",
                     help="append each test's CPU seconds, its processes' included, to FILE (tests/cpu_times.py)")


def _askers_dir(config) -> Path:
    return config.rootpath / ".pytest_cache" / "kiln-bf16"


class _Bf16Askers:
    """--bf16-askers: keeps the tests the last run recorded (after -m has selected the tier)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        files = list(_askers_dir(config).glob("*.txt"))
        if not files:
            raise pytest.UsageError("--bf16-askers: no record of a run to take them from; run the tests once first")
        asked = {line for f in files for line in f.read_text().splitlines()}
        keep = [i for i in items if i.nodeid in asked or i.nodeid.split("::", 1)[0] in asked]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_configure(config):
    if config.getoption("--bf16-askers"):
        config.pluginmanager.register(_Bf16Askers(), "kiln-bf16-askers")
    if config.getoption("--cpu-times"):
        from cpu_times import CpuTimes

        config.pluginmanager.register(CpuTimes(config.getoption("--cpu-times")), "kiln-cpu-times")


def pytest_sessionfinish(session):
    if session.config.getoption("--bf16-askers") or not hasattr(session, "items"):
        return
    folder = _askers_dir(session.config)
    folder.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"{worker}.txt").write_text("".join(f"{name}\n" for name in sorted(_ASKED)))
