"""kiln.hardware: the KILN_BF16 override that lets one machine answer as the other kind would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kiln.hardware as hardware
from kiln.precision import Precision, emulation_note, resolve


@pytest.mark.parametrize("answer, native", [("native", True), ("emulated", False), ("Native ", True)])
def test_kiln_bf16_overrides_what_the_cpu_says(monkeypatch, answer, native):
    monkeypatch.setenv("KILN_BF16", answer)
    caps = hardware.cpu_capability()
    assert caps["native_bf16"] is native and caps["bf16_overridden"]
    assert caps["capability"] == torch.backends.cpu.get_cpu_capability()  # the rest is the CPU's own
    assert hardware.native_low_precision("cpu", torch.bfloat16) is native
    from kiln.precision.auto import rule

    # auto: measured on the model where bf16 is native (fp32 until then), fp32 by rule where emulated
    assert (rule("cpu") is None) is native
    assert resolve("auto", "cpu") == "fp32" and Precision("auto", "cpu").mode == "fp32"
    assert (emulation_note("bf16-mixed", "cpu") is None) is native
    info = hardware.machine_info()
    assert info["native_bf16"] is native and info["bf16_overridden"]
    assert "by KILN_BF16" in hardware.machine_line(info)


def test_without_the_override_the_cpu_answers(monkeypatch):
    monkeypatch.delenv("KILN_BF16", raising=False)
    caps = hardware.cpu_capability()
    assert not caps["bf16_overridden"]
    assert caps["native_bf16"] == (caps["avx512_bf16"] or caps["amx"])
    assert "bf16_overridden" not in hardware.machine_info()
    monkeypatch.setenv("KILN_BF16", "")  # set but empty: the same as unset
    assert hardware.cpu_capability()["native_bf16"] == caps["native_bf16"]


def test_a_value_it_does_not_know_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KILN_BF16", "yes")
    with pytest.raises(ValueError, match=r"KILN_BF16='yes'.*'native' or 'emulated'"):
        resolve("auto", "cpu")


def test_the_override_reaches_a_kiln_process_and_its_choice_of_auto():
    # native: auto measures the model (kiln.precision.auto); emulated: fp32 by rule, unmeasured
    code = "from kiln.precision.auto import rule; r = rule('cpu'); print(r.mode if r else 'measure')"
    for answer, mode in (("native", "measure"), ("emulated", "fp32")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "KILN_BF16": answer}).stdout.strip()
        assert out == mode


def test_kiln_train_refuses_a_bad_override_before_it_builds_anything(monkeypatch, tmp_path, capsys):
    from kiln.commands import main

    monkeypatch.setenv("KILN_BF16", "maybe")
    code = main(["train", "configs/digits_mlp.yaml", f"train.output_dir={tmp_path}", "train.max_steps=1"])
    assert code == 2 and not any(tmp_path.iterdir())
    assert "KILN_BF16='maybe' is not understood" in capsys.readouterr().err
