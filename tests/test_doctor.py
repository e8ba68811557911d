"""kiln doctor: the report of this machine, each failure it names (its queries replaced by
broken ones), and the one-line import diagnosis that kiln train shares with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kiln.commands.doctor as doctor
from kiln._environment import import_diagnosis
from kiln.commands import main

ROOT = Path(__file__).resolve().parents[1]
NMS = "operator torchvision::nms does not exist"


@pytest.fixture
def broken_torchvision(tmp_path, monkeypatch):
    """A torchvision 0.28.0 on sys.path whose import fails as the index's CUDA build does beside
    a CPU torch. Returns the directory it is in (for a subprocess's PYTHONPATH)."""
    site = tmp_path / "site"
    (site / "torchvision").mkdir(parents=True)
    (site / "torchvision" / "__init__.py").write_text(f"raise RuntimeError({NMS!r})\n")
    (site / "torchvision-0.28.0.dist-info").mkdir()
    (site / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    return site


@pytest.fixture
def quick(monkeypatch):
    """collect() without the compile check and the optional packages (checked where a test
    names them): each test sees only the query it breaks."""
    monkeypatch.setattr(doctor, "CHECKED", ())


def _problems(report):
    return [f"{d['problem']}; fix: {d['fix']}" for d in report["problems"]]


# ----------------------------------------------------------------------------- this machine


# the optional packages other fast tests import anyway (the slow test below imports them all:
# mlflow alone takes seconds)
FAST_EXTRAS = ("transformers", "safetensors", "tensorboard")


def test_the_report_says_what_this_machine_has(monkeypatch):
    from kiln import hardware
    from kiln.precision import resolve

    monkeypatch.delenv("KILN_BF16", raising=False)
    monkeypatch.setattr(doctor, "CHECKED", FAST_EXTRAS)
    report = doctor.collect(compile=False)
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["build"] == ("CUDA" if torch.version.cuda else "CPU")
    assert report["cpu"]["model"] == hardware.cpu_model()
    assert report["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["cpu"]["logical"] == os.cpu_count()
    assert report["native"]["cpu"]["bf16"] == hardware.native_low_precision("cpu", torch.bfloat16)
    assert report["native"]["cpu"]["fp8"] is False
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    from kiln.precision.auto import rule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert report["auto_precision"] == {"device": device, "mode": resolve("auto", device),
                                        "how": "rule" if rule(device, whole_model=True) else "measured"}
    assert report["distributed"]["gloo"]["ok"] is True  # a one-process group and an all-reduce ran
    assert report["distributed"]["nccl"]["ok"] is (True if torch.cuda.is_available() else None)
    assert report["native_kernels"] == {"ok": True}
    for name in FAST_EXTRAS:  # the test extra installs them
        assert report["extras"][name]["imports"] is True, name
    assert report["problems"] == [] and report["compile"] == {"ran": False}
    text = doctor.render(report)
    assert len(text.splitlines()) <= 24  # one screen
    assert f"torch        {torch.__version__}" in text and "no problems found" in text


def test_kiln_doctor_json_is_one_screen_of_json(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "CHECKED", FAST_EXTRAS)
    assert main(["doctor", "--json", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 20
    report = json.loads(out)
    assert report["kiln"] == __import__("kiln").__version__ and report["problems"] == []


def test_the_compile_check_compiles_and_times_a_tiny_function(monkeypatch, quick):
    calls = []
    real = torch.compile

    def compile_eagerly(fn, **kwargs):  # the check as it runs, without inductor's seconds of compiling
        calls.append(fn)
        compiled = real(fn, backend="eager")

        def first_call_compiles(*args):
            time.sleep(0.3)  # what the timed first call must include
            return compiled(*args)

        return first_call_compiles

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    started = time.perf_counter()
    report = doctor.collect()
    elapsed = time.perf_counter() - started
    assert len(calls) == len(report["compile"]) >= 1
    # the first call's time (rounded to 10 ms), within the whole report's
    assert report["compile"]["cpu"]["ok"] is True and 0.3 - 0.005 <= report["compile"]["cpu"]["seconds"] <= elapsed


# ----------------------------------------------------------------------------- what it names


def test_a_cuda_torch_without_a_driver_is_a_problem_with_its_fix(monkeypatch, quick, capsys):
    def no_driver():
        raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
                           "and installed a driver from http://www.nvidia.com/Download/index.aspx")

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "init", no_driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = doctor.collect(compile=False)
    (line,) = _problems(report)
    assert "is a CUDA 12.8 build, but CUDA does not work here (Found no NVIDIA driver on your system." in line
    assert "nvidia-smi" in line and "torch's CPU build" in line
    assert report["gpus"] == [] and report["auto_precision"]["device"] == "cpu"
    assert doctor.main(compile=False) == 1
    out = capsys.readouterr().out
    assert "problem: torch" in out and "  fix: install or repair the NVIDIA driver" in out


def test_a_torchvision_built_for_another_torch_is_a_problem(broken_torchvision, quick):
    report = doctor.collect(compile=False)
    assert report["extras"]["torchvision"] == {"installed": True, "version": "0.28.0", "imports": False,
                                               "error": f"RuntimeError: {NMS}"}
    (line,) = _problems(report)
    assert line.startswith(f'torchvision 0.28.0 does not match torch {torch.__version__}: importing it fails '
                           f'with "{NMS}"; fix: pip uninstall torchvision')
    assert "BROKEN" in doctor.render(report)


def test_transformers_that_cannot_import_its_models_is_a_problem_naming_the_cause(monkeypatch, quick):
    class Transformers:  # transformers' lazy module, as it fails when torchvision is broken
        def __getattr__(self, name):
            try:
                raise RuntimeError(NMS)
            except RuntimeError as exc:
                raise ModuleNotFoundError(f"Could not import module '{name}'. Are this object's requirements "
                                          "defined correctly?") from exc

    monkeypatch.setitem(sys.modules, "transformers", Transformers())
    monkeypatch.setattr(doctor, "CHECKED", ("transformers",))
    report = doctor.collect(compile=False)
    assert report["extras"]["transformers"]["imports"] is False
    (line,) = _problems(report)
    assert line.startswith("transformers cannot import its models (GPT2LMHeadModel): torchvision does not match "
                           f"torch {torch.__version__}")
    assert "fix: pip uninstall torchvision" in line


def test_an_extra_that_does_not_import_is_a_problem(tmp_path, monkeypatch, quick):
    site = tmp_path / "site"
    (site / "wandb").mkdir(parents=True)
    (site / "wandb" / "__init__.py").write_text("raise ImportError('libwandb_core.so: cannot open shared object')\n")
    (site / "wandb-9.9.dist-info").mkdir()
    (site / "wandb-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: wandb\nVersion: 9.9\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(doctor, "CHECKED", ("wandb",))
    (line,) = _problems(doctor.collect(compile=False))
    assert line == ("wandb 9.9 is installed but does not import (ImportError: libwandb_core.so: cannot open shared "
                    "object); fix: pip install --force-reinstall wandb (or pip uninstall wandb if you do not use it)")


def test_an_extra_not_installed_is_listed_with_its_install_line_not_a_problem(monkeypatch, quick):
    monkeypatch.setattr(doctor, "package_version", lambda name: None)
    monkeypatch.setattr(doctor, "CHECKED", ("wandb", "mlflow"))
    report = doctor.collect(compile=False)
    assert report["extras"]["wandb"] == {"installed": False, "imports": False, "install": "pip install 'kiln[wandb]'"}
    assert report["problems"] == [] and "mlflow not installed" in doctor.render(report)


def test_a_gloo_that_does_not_start_is_a_problem(monkeypatch, quick):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:144] no error")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    report = doctor.collect(compile=False)
    assert report["distributed"]["gloo"] == {"ok": False, "error": "RuntimeError: Gloo connectFullMesh failed with "
                                             "[../gloo/transport/tcp/pair.cc:144] no error"}
    (line,) = _problems(report)
    assert line.startswith("the gloo backend does not start a one-process group") and "reinstall torch" in line


def test_compile_and_native_kernels_that_fail_are_warnings_not_problems(monkeypatch, quick, capsys):
    import kiln.optim

    def no_compiler(fn, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx")

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(doctor, "native_kernels_build", lambda: "RuntimeError: g++: not found")
    report = doctor.collect()
    assert report["problems"] == [] and len(report["warnings"]) == 1 + len(report["compile"])
    assert report["compile"]["cpu"]["ok"] is False
    assert doctor.main() == 0  # kiln trains without either
    out = capsys.readouterr().out
    assert "warning: torch.compile fails on cpu (RuntimeError: InvalidCxxCompiler" in out
    assert "warning: kiln's native LAMB/LARS kernels for CPU do not build (RuntimeError: g++: not found)" in out
    assert "C++ compiler" in out


def test_a_kiln_bf16_it_does_not_know_is_a_problem(monkeypatch, quick):
    monkeypatch.setenv("KILN_BF16", "perhaps")
    report = doctor.collect(compile=False)
    assert os.environ["KILN_BF16"] == "perhaps"  # set aside while the rest was collected, and back
    assert report["cpu"]["bf16_overridden"] is False  # the rest: what the CPU itself says
    (line,) = _problems(report)
    assert line.startswith("KILN_BF16='perhaps' is not understood") and "'native' or 'emulated'" in line


def test_every_command_answers_help(capsys):
    for command in ("train", "bench", "plan", "tune", "report", "export", "doctor"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--help"])
        assert stop.value.code == 0, command
        assert "usage: kiln " + command in capsys.readouterr().out


# ----------------------------------------------------------------------------- the import diagnosis


def _broken_model(tmp_path, monkeypatch, body: str) -> Path:
    """A YAML config whose model._target_ is brokenmodel.Net, defined by ``body``."""
    (tmp_path / "brokenmodel.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "brokenmodel", raising=False)
    config = tmp_path / "broken.yaml"
    config.write_text("model: {_target_: brokenmodel.Net, in_features: 64, out_features: 10}\n"
                      "data: {name: digits, batch_size: 64}\ntrain: {max_steps: 1}\n")
    return config


def test_kiln_train_names_a_torchvision_that_breaks_the_models_import(broken_torchvision, tmp_path, monkeypatch,
                                                                      capsys):
    config = _broken_model(tmp_path, monkeypatch, """
        import torch
        import torchvision  # as transformers does where it is installed
        class Net(torch.nn.Linear):
            pass
    """)
    assert main(["train", str(config), f"train.output_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"kiln: error: model._target_='brokenmodel.Net' cannot be imported: torchvision 0.28.0 does not "
                   f"match torch {torch.__version__}: importing it fails with \"{NMS}\"; fix: pip uninstall "
                   "torchvision (kiln does not need it; transformers imports it whenever it is installed), or install "
                   f"the torchvision release built for torch {torch.__version__} (its paired version, the same CPU "
                   "or CUDA build)")
    assert not (tmp_path / "runs").exists()


def test_kiln_train_names_it_when_the_model_imports_it_while_it_is_built(broken_torchvision, tmp_path, monkeypatch,
                                                                         capsys):
    config = _broken_model(tmp_path, monkeypatch, """
        import torch
        class Net(torch.nn.Linear):
            def __init__(self, **kwargs):
                import torchvision  # a lazy import, as transformers' model classes make
                super().__init__(**kwargs)
    """)
    assert main(["train", str(config), f"train.output_dir={tmp_path / 'runs'}", "train.progress=none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: building model._target_=brokenmodel.Net failed: torchvision 0.28.0 does not "
                          f"match torch {torch.__version__}: importing it fails with \"{NMS}\"; fix: pip uninstall")
    assert len(err.strip().splitlines()) == 1


def test_the_diagnosis_of_a_missing_extra_and_of_a_hidden_cause():
    try:
        import transformers_that_is_not_there  # noqa: F401
    except ModuleNotFoundError as exc:
        exc.name = "transformers"  # as Python names the top module that is missing
        assert str(import_diagnosis(exc)) == "transformers is not installed; fix: pip install 'kiln[hf]'"
    hidden = ModuleNotFoundError("Could not import module 'BertModel'. Are this object's requirements defined "
                                 "correctly?")
    found = import_diagnosis(hidden)
    assert "cannot import BertModel (transformers hides the original error)" in found.problem
    assert "set_verbosity_debug(); from transformers import BertModel" in found.fix
    assert import_diagnosis(ValueError("something else")) is None


@pytest.mark.e2e
def test_a_real_transformers_beside_a_broken_torchvision_doctor_and_train_say_the_same(broken_torchvision,
                                                                                        tmp_path):
    """As a user meets it: transformers imported for real beside the broken torchvision. kiln
    doctor exits 1 naming it, and kiln train configs/hf_gpt2_tiny.py gives the same line."""
    env = {**os.environ, "PYTHONPATH": str(broken_torchvision)}
    run = subprocess.run([sys.executable, "-m", "kiln", "doctor", "--json", "--no-compile"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    lines = _problems(report)
    assert any(line.startswith("transformers cannot import its models (GPT2LMHeadModel): torchvision 0.28.0 does "
                               "not match torch") for line in lines), lines
    train = subprocess.run([sys.executable, "-m", "kiln", "train", "configs/hf_gpt2_tiny.py",
                            f"train.output_dir={tmp_path}"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=300)
    assert train.returncode == 2
    torchvision_line = next(line for line in lines if line.startswith("torchvision"))
    assert train.stderr.strip().endswith(torchvision_line), (train.stderr, torchvision_line)


@pytest.mark.e2e
def test_kiln_doctor_runs_every_check_here():
    run = subprocess.run([sys.executable, "-m", "kiln", "doctor"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "compile      cpu works (first call" in run.stdout and "no problems found" in run.stdout
    for name in doctor.CHECKED:  # the test extra installs every one
        assert f" {name} " in run.stdout.split("extras", 1)[1] and "BROKEN" not in run.stdout
