"""kiln/bench/_harness.py: the one harness of every benchmark. A made-up benchmark goes through
it (the files, the printed report, the machine, docs/lab/benchmarks.md); tables align and group;
the timing helpers take turns and pair rounds; ``kiln bench hf`` without accelerate is refused
in one line before any work."""

from __future__ import annotations

import json
import sys
import time

import pytest

import kiln.hardware
from kiln.bench import BENCHMARKS, _harness as h, run_benchmark


def _measure(quick: bool = False, *, scale: float = 1.0) -> h.Result:
    rows = [{"model": "gpt", "method": "torch", "ms": 2.0 * scale, "ratio": None},
            {"model": "gpt", "method": "kiln", "ms": 1.0 * scale, "ratio": 2.0},
            {"model": "gpt", "method": "kiln2", "ms": 1.0 * scale, "ratio": 2.0},
            {"model": "bert", "method": "kiln", "ms": 3.0, "ratio": 1.5}]
    cols = [h.Col("model", "model", group=True), h.Col("method", "method"), h.Col("ms", "ms", ".2f"),
            h.Col("x torch", "ratio", ".2f")]
    chart = [h.Bars("ms", rows, "method", {"ms": "ms"}, lines={"one": 1.0}, marks={"half": lambda r: r["ms"] / 2}),
             h.Bars("stacked", rows, "method", {"ms": "ms", "again": "ms"}, stacked=True, horizontal=True, log=True)]
    return h.Result({"rows": rows, "quick": quick}, [h.Table(rows, cols, "a title")], "made up", chart,
                    {"kiln at most 1.5 ms": h.target(1.0 * scale, 1.5)}, ["a note"], threads=1)


run = h.benchmark("made-up", _measure)


def _measure_slowly(quick: bool = False, *, scale: float = 1.0) -> h.Result:
    time.sleep(0.2)
    return _measure(quick, scale=scale)


def test_a_benchmark_prints_and_writes_its_report(tmp_path, capsys):
    started = time.perf_counter()
    report = h.benchmark("made-up", _measure_slowly)(tmp_path, quick=True, scale=1.0)
    elapsed = time.perf_counter() - started
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "made-up.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "made-up.txt").read_text() == printed
    assert (tmp_path / "made-up.png").stat().st_size > 5_000
    assert printed.startswith("kiln bench made-up: made up\nmachine: ")
    assert report["machine"] == {**kiln.hardware.machine_info(), "threads": 1}
    assert kiln.hardware.machine_line(report["machine"]) in printed
    assert report["rows"][0]["ms"] == 2.0 and report["quick"] is True and report["benchmark"] == "made-up"
    assert report["targets"]["kiln at most 1.5 ms"]["met"] is True
    assert "target kiln at most 1.5 ms: 1 (at most 1.5): met" in printed and "note: a note" in printed
    assert set(report["load_average"]) == {"before", "after"}
    assert 0.2 <= report["seconds"] <= elapsed  # the measurement's own time, not the writing's or nothing


def test_table_aligns_numbers_right_words_left_and_prints_a_group_once():
    rows = _measure().tables[0]
    lines = rows.text().splitlines()
    assert lines[0] == "a title"
    assert lines[1].split() == ["model", "method", "ms", "x", "torch"] and set(lines[2]) == {"-"}
    assert lines[3:] == ["gpt    torch   2.00        -",
                         "       kiln    1.00     2.00",
                         "       kiln2   1.00     2.00",
                         "bert   kiln    3.00     1.50"]


def test_docs_keep_one_section_a_benchmark_and_the_latest_run(tmp_path):
    docs = tmp_path / "docs" / "benchmarks.md"
    run(tmp_path / "a", docs=docs, scale=1.0)
    h.benchmark("other", _measure)(tmp_path / "b", docs=docs)
    run(tmp_path / "a", docs=docs, scale=7.0)  # replaces its own section, keeps the other one
    text = docs.read_text()
    assert text.count("## kiln bench made-up") == 1 and text.count("## kiln bench other") == 1
    assert "7.00" in text.split("## kiln bench other")[0]  # the latest made-up run
    assert "machine: " + kiln.hardware.machine_line({**kiln.hardware.machine_info(), "threads": 1}) in text
    assert "Measured " in text and " UTC" in text


def test_a_section_of_a_written_page_is_replaced_in_place_and_the_page_kept(tmp_path):
    """docs/lab/gpu.md is prose with kiln bench gpu's section in it: a run replaces the section where it
    stands and leaves every other line of the page as it was."""
    page = tmp_path / "gpu.md"
    head, tail = "# kiln on GPUs\n\nprose before\n\n", "\n## Runs\n\nprose after\n"
    page.write_text(head + "<!-- kiln bench made-up -->\nnot run yet\n<!-- /kiln bench made-up -->\n" + tail)
    run(tmp_path / "a", docs=page, scale=1.0)
    run(tmp_path / "a", docs=page, scale=7.0)
    text = page.read_text()
    assert text.startswith(head + "<!-- kiln bench made-up -->\n## kiln bench made-up\n") and text.endswith(
        "<!-- /kiln bench made-up -->\n" + tail)
    assert text.count("## kiln bench made-up") == 1 and "not run yet" not in text and "7.00" in text


def test_interleaved_takes_turns_and_paired_ratios_are_per_round():
    calls = []
    times = h.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2,
                          repeats={"a": 2, "b": 1}, untimed=1)
    assert calls == ["a", "a", "a", "b", "b"] * 2
    assert [len(t) for t in times.values()] == [4, 2]
    ratio, by_round = h.paired([{"v": 2.0}, {"v": 9.0}, {"v": 3.0}], [{"v": 1.0}, {"v": 3.0}, {"v": 3.0}], "v")
    assert by_round == [2.0, 3.0, 1.0] and ratio == 2.0


def test_quick_runs_leave_the_docs_alone(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(h, "_write_docs", lambda *a: written.append(a))
    monkeypatch.setitem(BENCHMARKS, "made-up", (__name__, "made up"))  # this module's run
    run_benchmark("made-up", tmp_path, quick=True)
    assert written == [] and (tmp_path / "made-up.json").exists()
    run_benchmark("made-up", tmp_path)
    assert [a[1] for a in written] == ["made-up"]


def test_bench_hf_without_accelerate_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from kiln.commands import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    assert main(["bench", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "accelerate" in err and "pip install 'kiln[bench]'" in err, err
    assert list(tmp_path.iterdir()) == []  # no work began: not even the output folder


def test_no_benchmark_imports_matplotlib_before_it_draws(fresh_python):
    code = ("import sys, importlib, kiln.bench as b; [importlib.import_module(m) for m, _ in b.BENCHMARKS.values()]; "
            "print('matplotlib' in sys.modules)")
    out = fresh_python(code)
    assert out.strip() == "False"


def _device_run(quick: bool = False, device: str = "cpu") -> h.Result:
    return _measure(quick, scale=2.0 if device == "cuda" else 1.0)


def test_a_run_on_a_gpu_is_a_docs_section_of_its_own_beside_the_cpus(tmp_path):
    docs = tmp_path / "benchmarks.md"
    on = h.benchmark("made-up", _device_run)
    on(tmp_path / "cpu", docs=docs, device="cpu")
    report = on(tmp_path / "gpu", docs=docs, device="cuda")
    on(tmp_path / "cpu", docs=docs, device="cpu")  # replaces the CPU's section alone
    text = docs.read_text()
    assert text.count("## kiln bench made-up --device cuda\n") == 1 and text.count("## kiln bench made-up\n") == 1
    assert "4.00" in text.split("## kiln bench made-up --device cuda")[1]  # the GPU's figures under its heading
    assert (tmp_path / "gpu" / "made-up.txt").read_text().startswith("kiln bench made-up --device cuda: made up")
    assert report["rows"][0]["ms"] == 4.0


def test_device_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    import inspect

    import torch

    from kiln.bench import ON_DEVICE, check_benchmark, get_benchmark
    from kiln.commands import main

    # exactly the benchmarks whose measure takes a device say so
    assert {n for n in BENCHMARKS if "device" in inspect.signature(get_benchmark(n)).parameters} == set(ON_DEVICE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, words in ((["optimizer", "--device", "cuda"], ("sees no CUDA device", "kiln doctor")),
                        (["zero", "--device", "cuda"], ("takes no --device", "optimizer", "encoder-layer", "hf", "ddp")),
                        (["hf", "--device", "tpu0"], ("not a device torch knows",))):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs and torch sees 1"):
        check_benchmark("ddp", device="cuda")
    assert check_benchmark("encoder-layer", device="cuda") == {"device": "cuda"}
    assert check_benchmark("optimizer", device="cpu") == {"device": "cpu"}
    assert check_benchmark("gpu") == {"device": "cuda"}  # kiln bench gpu: on the GPU unless told
    assert list(tmp_path.iterdir()) == []  # no output folder was made


def test_hidden_and_nproc_are_checked_and_refused_where_not_taken(tmp_path, capsys, monkeypatch):
    import torch

    from kiln.bench import check_benchmark
    from kiln.commands import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, words in ((["vit", "--hidden", "1024"], ("takes no --hidden (only: encoder-layer)",)),
                        (["encoder-layer", "--nproc", "1"], ("takes no --nproc (only: vit)",)),
                        (["encoder-layer", "--hidden", "1000"], ("--hidden 1000", "multiple of its 16 heads")),
                        (["vit", "--nproc", "4"], ("--nproc 4", "1 process or 2")),
                        (["gpu"], ("sees no CUDA device", "kiln bench gpu --device cpu tests the script"))):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert check_benchmark("encoder-layer", hidden=1024) == {"hidden": 1024}
    assert check_benchmark("vit", nproc=1) == {"nproc": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="runs one process on one GPU"):
        check_benchmark("vit", device="cuda", nproc=2)
    assert check_benchmark("vit", device="cuda") == {"device": "cuda"}
    assert list(tmp_path.iterdir()) == []
