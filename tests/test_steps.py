"""An optimizer step sees the same samples however it is computed: split into accumulated
micro-batches, over data-parallel processes, across epoch ends, after a kill and resume, and
after a resume in another layout. The trainer's checks are in float64, to 1e-12."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from kiln.commands import main
from kiln.data import StepSampler
from kiln.train import load_checkpoint
from launched import kiln_here

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")

# 200 samples in steps of 48: 4 whole steps per epoch and 8 samples left over, so 14 steps
# cross three epoch ends; the schedule is constant so that a resumed run may run longer.
SMALL = ["data.name=synthetic_images", "data.args.num_samples=200", "data.args.val_samples=64",
         "data.batch_size=48", "train.precision=fp64", "optim.lr=1e-2", "optim.schedule=constant",
         "train.log_every=1", "train.progress=none"]


def _steps(n: int, batch: int, accumulate: int, world: int, epoch: int, **kw) -> list[list[int]]:
    """Each step's samples, gathered over every rank's micro-batches of that step."""
    samplers = [StepSampler(n, batch, accumulate=accumulate, rank=r, world_size=world, **kw) for r in range(world)]
    streams = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        streams.append(list(sampler))
    steps = samplers[0].steps_per_epoch
    assert all(len(stream) == steps * accumulate for stream in streams)  # an epoch is whole steps
    assert all(len(micro) > 0 for stream in streams for micro in stream)
    return [sorted(i for stream in streams for micro in stream[t * accumulate:(t + 1) * accumulate] for i in micro)
            for t in range(steps)]


@pytest.mark.parametrize("n, batch, accumulate, world, drop_last", [
    (100, 16, 4, 1, True), (100, 12, 3, 2, True), (103, 16, 2, 2, False), (101, 8, 1, 4, False), (96, 24, 2, 3, False),
])
def test_every_layout_splits_exactly_the_one_process_steps_in_every_epoch(n, batch, accumulate, world, drop_last):
    for epoch in range(3):
        one = _steps(n, batch, 1, 1, epoch, seed=5, drop_last=drop_last)
        assert _steps(n, batch, accumulate, world, epoch, seed=5, drop_last=drop_last) == one
        seen = [i for step in one for i in step]
        assert len(seen) == len(set(seen)) == (n - n % batch if drop_last else n)
        if not drop_last and n % batch:
            assert len(one[-1]) == n % batch  # the short last step keeps the tail
    assert _steps(n, batch, 1, 1, 0, seed=5) != _steps(n, batch, 1, 1, 1, seed=5)  # reshuffled per epoch


def test_one_process_order_is_the_distributed_samplers():
    # runs from before StepSampler keep their order: one process takes DistributedSampler's
    sampler = StepSampler(50, 8, seed=3)
    sampler.set_epoch(2)
    reference = DistributedSampler(TensorDataset(torch.arange(50)), num_replicas=1, rank=0, seed=3, shuffle=True)
    reference.set_epoch(2)
    assert [i for micro in sampler for i in micro] == list(reference)[:48]


def test_a_short_last_step_is_split_as_evenly_as_possible_and_never_empty():
    samplers = [StepSampler(53, 16, accumulate=2, rank=r, world_size=2, shuffle=False, drop_last=False)
                for r in range(2)]
    tails = [list(s)[-2:] for s in samplers]  # 53 % 16 = 5 samples over 2 ranks x 2 micro-batches
    assert sorted(len(m) for t in tails for m in t) == [1, 1, 1, 2]
    assert samplers[0].step_samples(3) == 5 and samplers[0].step_samples(0) == 16
    with pytest.raises(ValueError, match="empty"):
        StepSampler(51, 16, accumulate=2, world_size=2, drop_last=False)  # 3 samples for 4 micro-batches


def _run(tmp_path: Path, name: str, *overrides: str) -> Path:
    out = tmp_path / name
    assert main(["train", MLP, *SMALL, f"train.output_dir={out}", *overrides]) == 0
    (run,) = out.iterdir()
    return run


def _result(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((run / "summary.json").read_text()), load_checkpoint(run / "checkpoints" / "final")["model"]


def _assert_same_training(a: Path, b: Path, tol: float = 1e-12) -> None:
    (sa, wa), (sb, wb) = _result(a), _result(b)
    assert sa["steps"] == sb["steps"] and sa["epochs"] == sb["epochs"]
    assert sb["final_train_loss"] == pytest.approx(sa["final_train_loss"], rel=tol, abs=0)
    assert next(iter(wa.values())).dtype == torch.float64
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=tol, atol=tol)


@pytest.mark.parametrize("drop_last", [True, False])
def test_accumulation_is_the_whole_batch_step_across_epoch_ends(tmp_path, drop_last):
    common = ["train.max_steps=14", f"data.drop_last={str(drop_last).lower()}"]
    whole = _run(tmp_path, "whole", *common, "train.accumulate=1")
    split = _run(tmp_path, "split", *common, "train.accumulate=4")
    _assert_same_training(whole, split)
    summary, _ = _result(whole)
    # drop_last: 4 steps per epoch; otherwise 5 (the fifth holds the 8 samples left over)
    assert summary["epochs"] == pytest.approx(14 / 4 if drop_last else 14 / 5, abs=1e-4)


def test_a_batch_plan_that_leaves_an_empty_micro_batch_is_refused_before_training(tmp_path, capsys):
    # 202 % 48 = 10 samples in the last step, fewer than the 16 micro-batches that would split it
    out = tmp_path / "runs"
    code = main(["train", MLP, *SMALL, "data.args.num_samples=202", "data.drop_last=false", "train.accumulate=16",
                 "train.max_steps=2", f"train.output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "data.drop_last" in err and "train.accumulate=16" in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.e2e
def test_a_resume_with_other_accumulation_continues_the_same_training(tmp_path):
    whole = _run(tmp_path, "whole", "train.max_steps=14")
    part = _run(tmp_path, "part", "train.max_steps=6")  # stops mid-epoch (step 2 of epoch 1)
    assert main(["train", "--resume", str(part), "train.max_steps=14", "train.accumulate=2"]) == 0
    _assert_same_training(whole, part)


@pytest.mark.e2e
def test_kill_9_then_resume_across_epoch_ends_with_accumulation_is_bitwise(tmp_path, kill_9_at):
    args = [MLP, *SMALL, "train.max_steps=60", "train.accumulate=4", "train.checkpoint_every=7",
            "train.keep_checkpoints=2"]
    whole = _run(tmp_path, "whole", *args[1:])
    run = kill_9_at(args, tmp_path / "killed", "step-00000007")  # step 7: mid-epoch 1
    assert main(["train", "--resume", str(run)]) == 0
    _assert_same_training(whole, run, tol=0)


def _kiln(*args: str) -> None:
    out = kiln_here(*args)  # in this process: a kiln train --nproc N launcher without its own interpreter
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.distributed
def test_two_processes_with_accumulation_and_a_resume_into_them_train_like_one(tmp_path):
    one = _run(tmp_path, "one", "train.max_steps=14")
    _kiln("train", MLP, *SMALL, "train.max_steps=14", "train.accumulate=2", "--nproc", "2",
          f"train.output_dir={tmp_path / 'two'}")
    (two,) = (tmp_path / "two").iterdir()
    _assert_same_training(one, two)
    # one process for 6 steps, then two processes with accumulation for the rest
    part = _run(tmp_path, "part", "train.max_steps=6")
    _kiln("train", "--resume", str(part), "--nproc", "2", "train.max_steps=14", "train.accumulate=2")
    _assert_same_training(one, part)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_schedule_steps_as_torch_lambdalr_does(schedule, tensor_lr):
    """kiln's schedule is LambdaLR with a leaner step(): the same rates every step, in every
    group, float or tensor lr, and the same state dict (checkpoints keep their form)."""
    from omegaconf import OmegaConf
    from torch.optim import lr_scheduler

    from kiln.train._build import build_scheduler

    cfg = OmegaConf.create(dict(schedule=schedule, warmup_steps=3, min_lr_ratio=0.1, lr=1e-3))
    opts = []
    for _ in range(2):
        p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        opts.append(torch.optim.AdamW([{"params": [p]}, {"params": [q], "lr": 2e-3}],
                                      lr=torch.tensor(1e-3) if tensor_lr else 1e-3))
    ours = build_scheduler(cfg, opts[0], 20)
    torch_s = lr_scheduler.LambdaLR(opts[1], ours.lr_lambdas[0])
    seen = set()
    for _ in range(25):
        for opt, sched in zip(opts, (ours, torch_s)):
            opt.step()
            sched.step()
        rates = [[float(g["lr"]) for g in o.param_groups] for o in opts]
        assert rates[0] == rates[1] and [float(x) for x in ours.get_last_lr()] == rates[0]
        seen.add(rates[0][0])
    assert len(seen) == 2 if schedule == "constant" else len(seen) > 15  # the warm-up (and decay) really ran
    mine, theirs = ours.state_dict(), torch_s.state_dict()
    assert mine["last_epoch"] == theirs["last_epoch"] == 25 and mine["_step_count"] == theirs["_step_count"]


def test_a_constant_schedule_writes_the_rates_until_settled_and_again_after_a_load():
    """Past its warm-up a constant schedule's step only counts (the rates hold base * 1.0); the
    state dict keeps torch's keys, and a loaded schedule writes the rates at its next step, so a
    resumed run never keeps a rate the optimizer held before the load."""
    from omegaconf import OmegaConf
    from torch.optim import lr_scheduler

    from kiln.train._build import build_scheduler

    cfg = OmegaConf.create(dict(schedule="constant", warmup_steps=3, min_lr_ratio=0.1, lr=1e-3))
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1e-3)
    ours = build_scheduler(cfg, opt, 20)
    theirs = lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3), ours.lr_lambdas[0])
    assert set(ours.state_dict()) == set(theirs.state_dict())
    for _ in range(6):
        opt.step()
        ours.step()
    assert opt.param_groups[0]["lr"] == 1e-3 and ours._settled
    opt.param_groups[0]["lr"] = 5.0  # what an optimizer loaded from elsewhere might hold
    ours.step()
    assert opt.param_groups[0]["lr"] == 5.0  # settled: the step only counts
    ours.load_state_dict(ours.state_dict())
    ours.step()
    assert opt.param_groups[0]["lr"] == 1e-3 and ours.last_epoch == 8


def test_the_log_windows_loss_is_the_fp64_sum_in_step_order_bit_for_bit():
    """The loop hands each step's loss to the meter as a tensor; the window's sum, taken at the
    log step (and past the fold every 256 steps), is bit for bit that of adding each loss into an
    fp64 tensor in step order, and so is the checkpoint's."""
    from kiln.train._setup import Meter

    g = torch.Generator().manual_seed(0)
    # an fp64 run's losses, of magnitudes from 1e-6 to 1e6: a sum in another order rounds differently
    scale = 10.0 ** torch.randint(-6, 7, (300,), generator=g, dtype=torch.float64)
    losses = list(torch.randn(300, generator=g, dtype=torch.float64) * scale)
    meter, ref = Meter(torch.device("cpu")), torch.zeros((), dtype=torch.float64)
    for loss in losses:
        meter.add_loss(loss)
        ref += loss
    assert meter.window_steps == 300 and len(meter.window_pending) == 300 - 256
    assert meter.window_sum() == ref.item()
    assert meter.window_mean(1) == (ref / 300).item()
    assert meter.state_dict()["window"] == {"loss": ref.item(), "steps": 300}
    assert sum(float(x) for x in sorted(losses, key=abs)) != ref.item()  # (the order does matter here)
    fp32 = Meter(torch.device("cpu"))  # fp32 losses, as most runs give them, summed in fp64
    for loss in losses[:10]:
        fp32.add_loss(loss.float())
    assert fp32.window_sum() == sum((x.float().double() for x in losses[:10]), torch.zeros((), dtype=torch.float64)).item()
    meter.close_window()
    assert (meter.window_sum(), meter.window_steps, meter.window_pending) == (0.0, 0, [])


def test_a_batch_already_on_its_device_is_passed_through_and_others_are_moved():
    from kiln.train._tasks import to_device

    x, y = torch.randn(4, 3), torch.arange(4)
    batch = [x, y]
    assert to_device(batch, torch.device("cpu"), torch.float32) is batch  # no new container a step
    moved = to_device((x, y), torch.device("cpu"), torch.float64)
    assert type(moved) is tuple and moved[0].dtype == torch.float64 and moved[1] is y
    assert torch.equal(moved[0], x.double())
    assert to_device({"a": x}, torch.device("cpu"), torch.float32) == {"a": x}
