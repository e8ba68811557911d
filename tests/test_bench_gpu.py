"""``kiln bench gpu``: each benchmark in a process of its own, its lines printed as they come; one
that fails, hangs or is refused costs its own row and nothing else; the budget is kept; the report
goes into docs/lab/gpu.md from a GPU only. The whole script runs here with ``--device cpu``."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kiln.bench import BENCHMARKS, gpu
from kiln.bench import _harness as h
from kiln.bench import run_benchmark


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_process_s_lines_are_printed_as_they_come_under_a_prefix(capsys):
    done = gpu.run_process(_python("""
        import sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    """), 60, prefix="  > ")
    assert done["status"] == "failed" and done["exit"] == 3
    assert done["last_lines"] == ["to stdout", "to stderr"] and done["seconds"] < 60
    assert capsys.readouterr().out == "  > to stdout\n  > to stderr\n"
    assert gpu.run_process(_python("print('fine')"), 60)["status"] == "ok"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "\nState:\tZ" in status.read_text()  # a zombie no parent has reaped yet


def test_at_its_limit_a_benchmark_and_every_process_it_started_are_ended(tmp_path):
    """The timed-out benchmark's own processes (a loader's workers, gloo ranks) go with it: its
    session's whole group is ended. What it printed before its limit is kept."""
    pid_file = tmp_path / "grandchild"
    started = time.perf_counter()
    done = gpu.run_process(_python(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("compiling", flush=True)
        time.sleep(120)
    """), 3)
    assert done["status"] == "timeout" and done["exit"] is None and done["last_lines"] == ["compiling"]
    assert time.perf_counter() - started < 20
    deadline = time.time() + 10
    while not _gone(int(pid_file.read_text())) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(int(pid_file.read_text()))


def test_a_signal_that_ends_kiln_bench_gpu_ends_the_benchmark_it_runs(tmp_path):
    """A benchmark runs in a session of its own, out of reach of its parent's signals: when the
    parent is told to end (SIGTERM, as when a lease ends), it ends the benchmark first."""
    import signal
    import subprocess

    pid_file = tmp_path / "benchmark"
    script = f"""
        import sys
        from kiln.bench import gpu
        gpu.run_process([sys.executable, "-c", "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                         "print('started', flush=True); time.sleep(120)"], 120)
    """
    parent = subprocess.Popen(_python(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert parent.stdout.readline() == "  | started\n"
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=30)
    assert parent.returncode != 0 and "KeyboardInterrupt: kiln bench gpu: SIGTERM" in out
    deadline = time.time() + 10
    while not _gone(int(pid_file.read_text())) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(int(pid_file.read_text()))


def _fake(run: gpu.Run, device: str, out: Path) -> list[str]:
    """Stand-ins for the benchmarks' processes, by name: one writes a report, one fails as a CUDA
    fault would, one hangs."""
    folder = out / run.name
    if run.name == "optimizer":
        report = {"targets": {"a": {"met": True}, "b": {"met": False}}}
        return _python(f"""
            import json, pathlib
            folder = pathlib.Path({str(folder)!r}); folder.mkdir(parents=True)
            (folder / "optimizer.json").write_text(json.dumps({report!r}))
            (folder / "optimizer.txt").write_text("kiln bench optimizer: its own table\\n")
            print("timing")
        """)
    if run.name == "plan":
        return _python("""
            import sys
            print("Traceback (most recent call last):")
            print("RuntimeError: CUDA error: an illegal memory access was encountered")
            sys.exit(1)
        """)
    if run.name == "encoder-layer":
        return _python("import time; print('compiling', flush=True); time.sleep(120)")
    raise AssertionError(f"{run.name} was not to be started")


def test_one_failing_or_hanging_benchmark_costs_its_own_row_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "command", _fake)
    monkeypatch.setattr(gpu, "RUNS", (
        gpu.Run("no-such-bench", 30),  # as lm is until it lands
        gpu.Run("optimizer", 30),
        gpu.Run("plan", 30),
        gpu.Run("encoder-layer", 2),
        gpu.Run("vit", 30, {"hidden": 1024}),  # an option it does not take: refused before it starts
        gpu.Run("hf", 30),  # by then the budget is spent
    ))
    monkeypatch.setattr(gpu, "CPU_SLOWER", 1)
    monkeypatch.setattr(gpu, "MIN_START_S", 5.0)
    monkeypatch.setitem(gpu.BUDGET_S, "cpu", 7.0)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "gpu.md").write_text("# kiln on GPUs\n")
    monkeypatch.setattr(h, "DOCS", docs / "benchmarks.md")
    report = run_benchmark("gpu", tmp_path / "out", device="cpu")  # a full run, but on a CPU
    printed = capsys.readouterr().out
    runs = report["runs"]
    assert [r["status"] for r in runs] == ["not available", "ok", "failed", "timeout", "refused", "not run"]
    assert runs[0]["note"] == "not available in this build"
    assert runs[1]["targets"] == "1/2 met" and runs[1]["report"]["targets"]["a"]["met"] is True
    assert runs[2]["note"] == "exit 1: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert runs[3]["note"] == "ended at its limit of 2 s; last line: compiling" and runs[3]["seconds"] < 15
    assert "takes no --hidden (only: encoder-layer)" in runs[4]["note"]
    assert "budget" in runs[5]["note"] and runs[5]["seconds"] is None
    # progress as it went, and every benchmark's own report after the table
    assert "[gpu 2/6, 0 s of 7] optimizer: kiln bench optimizer --quick --device=cpu (limit 7 s)" in printed
    assert "  | timing\n" in printed and "  | compiling\n" in printed
    text = (tmp_path / "out" / "gpu.txt").read_text()
    assert "kiln bench optimizer: its own table" in text and "kiln bench plan: failed after" in text
    assert json.loads((tmp_path / "out" / "gpu.json").read_text())["runs"][2]["status"] == "failed"
    assert (docs / "gpu.md").read_text() == "# kiln on GPUs\n"  # a CPU's run is a test, never the GPU page's
    assert not (docs / "benchmarks.md").exists()


def test_the_command_of_each_benchmark_and_the_budget():
    assert [r.name for r in gpu.RUNS] == ["lm", "vit", "encoder-layer", "hf", "optimizer", "plan"]
    assert sum(r.limit_s for r in gpu.RUNS) == gpu.BUDGET_S["cuda"] == 480
    enc = next(r for r in gpu.RUNS if r.name == "encoder-layer")
    argv = gpu.command(enc, "cuda", Path("/o"))
    assert argv[:3] == [sys.executable, "-m", "kiln"]
    assert argv[3:] == ["bench", "encoder-layer", "--quick", "--device=cuda", "--hidden=1024", "--out=/o/encoder-layer"]
    assert gpu.command(enc, "cpu", Path("/o"))[7] == "--hidden=64"  # the CPU's test of the script: a tiny layer
    vit = next(r for r in gpu.RUNS if r.name == "vit")
    assert "--nproc=1" in gpu.command(vit, "cpu", Path("/o")) and "--nproc=1" in gpu.command(vit, "cuda", Path("/o"))


def test_the_gpu_page_is_written_from_a_gpu_and_only_by_a_full_run(tmp_path, monkeypatch):
    import torch

    import kiln.bench as bench

    docs_seen = []

    def fake_run(out, quick=False, *, docs=None, device="cuda"):
        docs_seen.append(docs)
        return {}

    real = bench.get_benchmark
    monkeypatch.setattr(bench, "get_benchmark", lambda name: fake_run if name == "gpu" else real(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run_benchmark("gpu", tmp_path)  # default: cuda
    run_benchmark("gpu", tmp_path, quick=True)
    run_benchmark("gpu", tmp_path, device="cpu")
    assert docs_seen[0] == h.DOCS.with_name("gpu.md") and docs_seen[1:] == [None, None]


@pytest.mark.e2e  # three of the six benchmarks' quick forms on this CPU, each in its own process: ~60 s
def test_kiln_bench_gpu_runs_on_a_cpu(tmp_path, capsys, monkeypatch):
    """The script a lent GPU runs first, run here at the CPU's quick sizes, over three of its
    benchmarks: one with options of its own on a CPU (encoder-layer), the optimizer and the plan.
    (All six ran on an H200 on 2026-11-28 in 268 s; each one's quick form has its own test, and
    the six together took 174-246 s of this CI's 2 cores.)"""
    from kiln.commands import main

    monkeypatch.setattr(gpu, "RUNS", tuple(r for r in gpu.RUNS if r.name in ("encoder-layer", "optimizer", "plan")))
    page = h.DOCS.with_name("gpu.md")
    before = page.read_text()
    assert main(["bench", "gpu", "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu.json").read_text())
    status = {r["benchmark"]: r["status"] for r in report["runs"]}
    assert status == {"encoder-layer": "ok", "optimizer": "ok", "plan": "ok"}, report["runs"]
    runs = {r["benchmark"]: r for r in report["runs"]}
    assert runs["encoder-layer"]["report"]["setup"]["hidden"] == 64  # the GPU's 1024 is not for this CPU
    for name in status:
        assert (tmp_path / name / f"{name}.json").exists()
        assert runs[name]["report"]["machine"]["cpu"] == report["machine"]["cpu"]
    assert "[gpu 3/3, " in printed and "] plan: ok in " in printed and "\n  | " in printed
    assert report["total_s"] < gpu.BUDGET_S["cpu"]
    assert page.read_text() == before
