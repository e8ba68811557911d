"""``train.precision=fp8`` (kiln/precision/fp8.py): refused in one line where it cannot train (a
CPU, a GPU below compute capability 8.9, no torchao), the config value, which linears the
conversion turns into torchao's Float8Linear (on the meta device), the plan's figure of the
float8 casts, the doctor's line; on a GPU of capability 8.9+ (the device tier), the loss of a
few hundred steps of gpt_tiny against bf16-mixed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import hardware
from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.models import create_model
from kiln.precision import Precision

ROOT = Path(__file__).resolve().parents[1]
GPT_TINY = str(ROOT / "configs" / "gpt_tiny.py")
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'kiln[fp8]')")


def _gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    """This machine seen as one CUDA GPU of ``capability`` (what kiln.hardware asks of torch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def _no_torchao(monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name == "torchao" else find_spec(name, package))


# ---------------------------------------------------------------------------------- the refusal


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's refusal")
@needs_torchao
def test_fp8_is_refused_on_a_cpu_in_one_line_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr("kiln.train.build_model", lambda *a, **k: built.append(1))
    for device in ("auto", "cpu"):
        with pytest.raises(ConfigError) as err:
            load_config(GPT_TINY, ["train.precision=fp8", f"train.device={device}"])
        line = str(err.value)
        assert "\n" not in line and built == []
        assert line == ("train.precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper) "
                        "and torchao (pip install 'kiln[fp8]'); this machine has no CUDA GPU; use "
                        "train.precision=bf16-mixed")
    with pytest.raises(ConfigError, match="no CUDA GPU"):  # kiln's own loop: the policy asks too
        Precision("fp8", "cpu")


@needs_torchao
def test_fp8_is_refused_on_a_gpu_below_compute_capability_8_9(monkeypatch):
    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as err:
        load_config(GPT_TINY, ["train.precision=fp8", "train.device=cuda"])
    assert "this machine has NVIDIA A100-SXM4-80GB (compute capability 8.0);" in str(err.value)
    assert "compute capability 8.9 or later" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"compute capability 8\.0"):
        Precision("fp8", "cuda")
    _gpu(monkeypatch, (8, 9), "NVIDIA L4")  # Ada: float8 tensor cores
    assert load_config(GPT_TINY, ["train.precision=fp8", "train.device=cuda"]).train.precision == "fp8"
    assert hardware.fp8_problem("cuda") is None and hardware.fp8_lacks("cuda") == []


def test_fp8_is_refused_without_torchao_naming_the_extra(monkeypatch):
    _gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    _no_torchao(monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config(GPT_TINY, ["train.precision=fp8", "train.device=cuda"])
    assert str(err.value).endswith("this machine has no torchao; use train.precision=bf16-mixed")
    assert "pip install 'kiln[fp8]'" in str(err.value)
    with pytest.raises(ConfigError, match="no torchao"):
        Precision("fp8", "cuda")
    # a GPU without float8 and no torchao: both said at once
    _gpu(monkeypatch, (7, 5), "Tesla T4")
    assert hardware.fp8_lacks("cuda") == ["Tesla T4 (compute capability 7.5)", "no torchao"]


def test_the_config_knows_fp8_and_the_other_modes_do_not_ask_for_it(monkeypatch):
    _gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    if not HAS_TORCHAO:
        monkeypatch.setattr(hardware, "fp8_problem", lambda device: None)
    cfg = load_config(GPT_TINY, ["train.precision=fp8", "train.device=cuda"])
    assert cfg.train.precision == "fp8"
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(GPT_TINY, ["train.precision=fp9"])
    _no_torchao(monkeypatch)  # bf16-mixed never asks for torchao
    assert load_config(GPT_TINY, ["train.precision=bf16-mixed"]).train.precision == "bf16-mixed"


def test_the_fp8_policy_is_bf16_mixed_around_the_float8_linears(monkeypatch):
    monkeypatch.setattr(hardware, "fp8_problem", lambda device: None)
    policy = Precision("fp8", "cuda")
    assert policy.mode == "fp8" and policy.autocast_dtype == torch.bfloat16 and policy.scaler is None
    assert policy.param_dtype == torch.float32 and policy.input_dtype == torch.float32
    model = nn.Sequential(nn.Linear(32, 32))
    Precision("fp32", "cpu").convert(model)  # a no-op in every other mode
    assert type(model[0]) is nn.Linear


# ---------------------------------------------------------------------- the conversion (meta)


@needs_torchao
def test_the_conversion_on_meta_turns_the_linears_with_dims_of_16_into_float8_ones():
    from torchao.float8.float8_linear import Float8Linear

    from kiln.precision.fp8 import apply_fp8

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = create_model("gpt", vocab_size=512, dim=64, depth=2, heads=2, seq_len=32)
            self.odd = nn.Linear(64, 40)  # 40 features: not a multiple of 16
            self.probe = nn.Linear(64, 64)
            self.tied = nn.Linear(64, 512, bias=False)
            self.tied.weight = self.gpt.embed.tok.weight  # a linear reading an embedding's: an output projection

    with torch.device("meta"):
        net = Net()
    before = dict(net.named_parameters())
    layers = apply_fp8(net, skip=["probe"])
    blocks = [f"gpt.blocks.{i}.{p}" for i in range(2)
              for p in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc1", "mlp.fc2")]
    assert layers.converted == blocks
    assert layers.skipped == {"gpt.head.out": "the output projection",
                              "odd": "64 -> 40 features: float8 matmuls need multiples of 16",
                              "probe": "skipped by name", "tied": "the output projection"}
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            assert (type(module) is Float8Linear) == (name in blocks), name
    # names and the very parameters unchanged: a checkpoint loads into either model
    after = dict(net.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert all(p.is_meta for p in after.values())


@needs_torchao
def test_a_model_with_no_linear_to_convert_warns_that_it_trains_in_bf16_mixed():
    from kiln.errors import KilnWarning
    from kiln.precision.fp8 import apply_fp8

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    with pytest.warns(KilnWarning, match="found no linear layer to train in float8 among 2"):
        layers = apply_fp8(model)
    assert layers.converted == [] and set(layers.skipped) == {"0", "2"}
    with pytest.raises(ValueError, match="the model itself is an nn.Linear"):
        apply_fp8(nn.Linear(16, 16, device="meta"))


@needs_torchao
def test_float8_linears_compute_what_bf16_ones_do_to_float8_rounding():
    """On the CPU torch's _scaled_mm runs float8 in software: the numbers of rowwise float8, slowly
    (kiln refuses a CPU for speed, not for correctness)."""
    from kiln.precision.fp8 import apply_fp8

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    fp8 = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    fp8.load_state_dict(ref.state_dict())
    assert apply_fp8(fp8).converted == ["0", "2"]
    x = torch.randn(256, 64)
    outs, grads = [], []
    for model in (ref, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        outs.append(y.float())
        grads.append(model[0].weight.grad)
    assert outs[1].dtype == torch.float32 and grads[1].dtype == torch.float32
    # e4m3 keeps 3 bits of mantissa (relative rounding up to 2**-4 a value; errors average out in a
    # sum): a few percent of the output's scale, and not zero (the matmuls did run in float8)
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    gerr = (grads[1] - grads[0]).norm() / grads[0].norm()
    assert 1e-3 < err < 0.06 and 1e-3 < gerr < 0.1, (err, gerr)


# ---------------------------------------------------------------------------------- kiln plan


def test_the_float8_casts_of_gpt_tiny_as_the_plan_states_them():
    from kiln.precision.fp8 import fp8_memory

    with torch.device("meta"):
        model = create_model("gpt", vocab_size=256, dim=64, depth=4, heads=4, seq_len=64)
    mem = fp8_memory(model, tokens=32 * 64)
    # the largest backward: fc1, 64 -> 256 over M = 2048 tokens: 2MN + KN + MK bytes of float8
    # and 4(M + N + 2K) of scales
    m, k, n = 2048, 64, 256
    assert mem.layer == "blocks.0.mlp.fc1"
    assert mem.casts == 2 * m * n + k * n + m * k + 4 * (m + n + 2 * k) == 1_205_760
    # the bf16 weight copies autocast keeps for backward: 4 blocks x (4 x 64x64 + 2 x 64x256) x 2 bytes
    assert mem.saved == 4 * (4 * 64 * 64 + 2 * 64 * 256) * 2 == 393_216


@needs_torchao
def test_kiln_plan_shows_the_fp8_line(monkeypatch):
    from kiln.plan import describe

    cfg = load_config(GPT_TINY, ["train.precision=fp8", "train.device=cuda"])  # (trusted: no GPU here)
    text = describe(cfg)
    assert "fp8         24 of 25 linear layers in float8 (rowwise), in bf16: head.out: the output projection" in text
    assert ("float8 casts and scales 1.1 MB at most at once (blocks.0.mlp.fc1's backward, 2,048 tokens), none "
            "between steps; the bf16 weight copies bf16-mixed keeps for backward, 0.4 MB, are not made") in text
    assert "fp8 " not in describe(load_config(GPT_TINY, ["train.precision=fp32"]))


# The CPU runs float8 in software: with the refusal lifted, the set-up and step kiln train runs
# convert the linears there too (slowly: these are e2e)
SMALL = ["model.dim=32", "model.depth=1", "model.heads=2", "model.seq_len=32", "data.args.seq_len=32",
         "data.batch_size=8", "train.device=cpu"]


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:train.precision=bf16-mixed:UserWarning")  # (bf16 emulated: the reference)
@needs_torchao
def test_the_traced_plan_of_fp8_keeps_no_bf16_weight_copies_as_fp8_memory_says(monkeypatch):
    from kiln.plan import plan
    from kiln.precision.fp8 import fp8_memory

    monkeypatch.setattr(hardware, "fp8_problem", lambda device: None)
    traced = {mode: plan(load_config(GPT_TINY, [f"train.precision={mode}", *SMALL])).ranks[0]
              for mode in ("bf16-mixed", "fp8")}
    with torch.device("meta"):
        model = create_model("gpt", vocab_size=256, dim=32, depth=1, heads=2, seq_len=32)
    saved = fp8_memory(model, tokens=8 * 32).saved
    assert saved == (4 * 32 * 32 + 2 * 32 * 128) * 2
    # the step's activations at its peak: bf16-mixed's less the bf16 weight copies autocast keeps
    # for backward (lay_out converted the linears: else the two traces would be the same)
    assert traced["bf16-mixed"].activations - traced["fp8"].activations == saved


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:train.precision=bf16-mixed:UserWarning")  # (bf16 emulated: the reference run)
@needs_torchao
def test_kiln_train_with_fp8_on_the_cpu_trains_float8_linears_near_bf16_mixed(monkeypatch, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from kiln.train import train

    monkeypatch.setattr(hardware, "fp8_problem", lambda device: None)
    losses = {}
    for mode in ("bf16-mixed", "fp8"):
        cfg = load_config(GPT_TINY, [f"train.precision={mode}", *SMALL, "train.max_steps=4", "train.log_every=1",
                                     "train.eval_every=0", "train.progress=none", f"train.output_dir={tmp_path}"])
        result = train(cfg, name=mode)
        assert result.summary["precision"] == mode
        losses[mode] = result.summary["final_train_loss"]
        (final,) = (result.run_dir / "checkpoints").iterdir()
        losses[mode + " keys"] = set(FileSystemReader(final).read_metadata().state_dict_metadata)
        if mode == "fp8":  # one block's six linears converted where the layout was built
            assert result.summary["precision_fp8"] == {"recipe": "rowwise", "float8_linears": 6,
                                                       "bf16_linears": {"head.out": "the output projection"}}
        else:
            assert "precision_fp8" not in result.summary
    assert losses["fp8 keys"] == losses["bf16-mixed keys"]  # the same names: checkpoints cross
    assert losses["fp8"] != losses["bf16-mixed"] and abs(losses["fp8"] - losses["bf16-mixed"]) < 0.02, losses


# ---------------------------------------------------------------------------------- kiln doctor


def test_the_doctor_says_whether_fp8_can_train_here(monkeypatch):
    import kiln.commands.doctor as doctor

    _gpu(monkeypatch, (8, 6), "NVIDIA RTX A6000")
    _no_torchao(monkeypatch)
    gpus = [{"index": 0}]
    report = doctor._fp8(gpus)
    assert report["ok"] is False and report["lacks"] == ["NVIDIA RTX A6000 (compute capability 8.6)", "no torchao"]
    monkeypatch.undo()
    _gpu(monkeypatch, (9, 0), "NVIDIA H200")
    monkeypatch.setattr(hardware, "fp8_lacks", lambda device: [])
    assert doctor._fp8(gpus) == {"ok": True, "device": "cuda:0"}


# --------------------------------------------------------------------------- the GPU (device tier)


@pytest.fixture
def fp8_gpu(cuda) -> torch.device:
    """A GPU fp8 trains on (conftest's ``cuda`` skips without one); else skipped with the line a
    config asking for fp8 is refused with (compute capability below 8.9, no torchao)."""
    problem = hardware.fp8_problem(cuda)
    if problem is not None:
        pytest.skip(problem)
    return cuda


# fp8 against bf16-mixed on gpt_tiny, 300 steps: the eval loss within this many nats (e4m3's
# 3-bit mantissa against bf16's 8 changes each step's numbers; the training must end the same)
EVAL_LOSS_TOLERANCE = 0.05


@pytest.mark.gpu
def test_fp8_trains_gpt_tiny_as_bf16_mixed_does_on_a_gpu(fp8_gpu, tmp_path):
    from kiln.train import read_metrics, train

    runs = {}
    for mode in ("bf16-mixed", "fp8"):
        cfg = load_config(GPT_TINY, [f"train.precision={mode}", "train.device=cuda", "train.max_steps=300",
                                     "train.eval_every=0", "train.log_every=20", "train.progress=none",
                                     f"train.output_dir={tmp_path / mode}"])
        result = train(cfg, name=mode)
        assert result.summary["precision"] == mode
        runs[mode] = (result.summary["eval"]["loss"], [float(r["train_loss"]) for r in read_metrics(result.run_dir)
                                                       if r["train_loss"]])
    (bf16, bf16_curve), (fp8, fp8_curve) = runs["bf16-mixed"], runs["fp8"]
    assert math.isfinite(fp8) and fp8 < 2.0, runs  # it learned (ln 256 = 5.5 at the start)
    assert abs(fp8 - bf16) < EVAL_LOSS_TOLERANCE, f"eval loss fp8 {fp8:.4f}, bf16-mixed {bf16:.4f}"
    # every logged window's mean loss within 5% of bf16-mixed's
    assert len(fp8_curve) == len(bf16_curve) >= 15
    worst = max(abs(a - b) / b for a, b in zip(fp8_curve, bf16_curve))
    assert worst < 0.05, (worst, fp8_curve, bf16_curve)


@pytest.mark.gpu
def test_fp8_layers_are_float8_on_the_gpu_and_match_bf16_to_float8_rounding(fp8_gpu):
    from torchao.float8.float8_linear import Float8Linear

    from kiln.precision.fp8 import apply_fp8

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    fp8 = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    fp8.load_state_dict(ref.state_dict())
    apply_fp8(fp8)
    assert type(fp8[0]) is Float8Linear
    x = torch.randn(1024, 256, device="cuda")
    outs = []
    for model in (ref, fp8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(model(x).float())
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 1e-3 < err < 0.06, err
