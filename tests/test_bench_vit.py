"""``kiln bench vit``: the rows are what they claim (config keys, read back from the runs), and
``--quick`` writes the table's files with positive numbers and neutral techniques stay neutral."""

from __future__ import annotations

import json

import pytest

from kiln.bench import BENCHMARKS, run_benchmark
from kiln.bench.vit import BATCH, GPU_CONFIG, SIZES, check_nproc, rows

# (precision, pool, batch_first, optimizer, zero, compile): what each row of the article's table is
CLAIMED = [
    ("fp32", "cls", True, "torch-forloop", 0, False),      # 1 baseline: fp32, class token, batch-first, AdamW for-loop, DDP
    ("bf16-mixed", "cls", True, "torch-forloop", 0, False),  # 2 + AMP
    ("bf16-mixed", "cls", True, "torch-forloop", 3, False),  # 3 + FSDP (ZeRO-3)
    ("bf16-mixed", "cls", True, "kiln", 3, False),         # 4 + multi-tensor optimizer
    ("bf16-mixed", "mean", True, "kiln", 3, False),        # 5 + pooled classifier
    ("bf16-mixed", "mean", False, "kiln", 3, False),       # 6 + batch-second
    ("bf16-mixed", "mean", False, "kiln", 3, True),        # 7 + torch.compile
    ("bf16-mixed", "mean", False, "kiln", 3, True),        # 8 + larger batch
    ("bf16-true", "mean", False, "kiln", 2, True),         # 9 + full low precision (ZeRO-2: no arena under FSDP2)
]
KEYS = ("train.precision", "model.pool", "model.batch_first", "optim.impl", "parallel.zero", "train.compile")


def _claimed(keys: dict) -> tuple:
    return tuple(keys[k] for k in KEYS)


@pytest.mark.parametrize("quick", [False, True])
def test_each_row_adds_what_it_claims(quick):
    table = rows(quick)
    assert [_claimed(r["keys"]) for r in table] == CLAIMED
    batches = [r["keys"]["data.batch_size"] for r in table]
    assert batches[:7] == [BATCH] * 7 and batches[7] == batches[8] > BATCH  # row 8: the larger batch
    samples = {r["keys"]["data.batch_size"] * r["keys"]["train.max_steps"] for r in table}
    assert len(samples) == 1  # every row trains the same number of samples
    # each row changes only its own keys (row 8: batch, steps and lr; row 9: precision and zero)
    for before, row in zip(table, table[1:]):
        changed = sorted(k for k in row["keys"] if row["keys"][k] != before["keys"].get(k))
        assert changed == row["changed"], row["name"]
        assert len(changed) == 1 or row["name"].startswith(("+ batch", "+ bf16-true")), row["name"]


@pytest.mark.parametrize("device, quick", [("cpu", True), ("cuda", True), ("cuda", False)])
def test_on_one_device_fsdp_is_marked_not_applicable_and_nothing_is_sharded(device, quick):
    """One GPU (or --nproc 1) is one data-parallel rank: row 3 stays in the table, marked and not
    run, and no row claims a sharding it cannot have (ZeRO-3 and ZeRO-2 at dp=1 shard nothing)."""
    table = rows(quick, device, nproc=1)
    # the article's rows, in its order (row 8 names its batch)
    def named(t: list) -> list:
        return [r["name"] if not r["name"].startswith("+ batch") else "+ batch" for r in t]

    assert named(table) == named(rows(quick)) and table[7]["name"].startswith("+ batch")
    fsdp = table[2]
    assert fsdp["name"] == "+ FSDP" and fsdp["skip"].startswith("not applicable on one device")
    assert [r for r in table if "skip" in r] == [fsdp]
    assert fsdp["keys"] == table[1]["keys"] and fsdp["changed"] == []
    assert {r["keys"]["parallel.zero"] for r in table} == {0}
    assert table[8]["name"] == "+ bf16-true" and table[8]["changed"] == ["train.precision"]
    assert len({r["keys"]["data.batch_size"] * r["keys"]["train.max_steps"] for r in table}) == 1
    compiled = [r["name"] for r in table if r["keys"]["train.compile"]]
    # a GPU's quick form compiles ViT-B/16 once, in its own row; a full run compiles from row 7 on
    assert compiled == (["+ torch.compile"] if device == "cuda" and quick else [r["name"] for r in table[6:]])
    for before, row in zip(table, table[1:]):
        assert row["changed"] == sorted(k for k in row["keys"] if row["keys"][k] != before["keys"][k]), row["name"]


def test_the_gpu_table_is_vit_b16_at_batch_128_on_one_process():
    sizes = SIZES["cuda"]
    assert sizes.config == GPU_CONFIG and (sizes.batch, sizes.large_batch) == (128, 256)
    table = rows(device="cuda")
    assert [r["keys"]["data.batch_size"] for r in table] == [128] * 7 + [256] * 2
    assert "DDP" not in table[0]["adds"] and "one process" in table[0]["adds"]
    assert rows(device="cuda") == rows(device="cuda", nproc=1)


def test_nproc_is_1_or_2_and_1_on_a_gpu():
    assert check_nproc(1, "cuda") == 1 and check_nproc(2) == 2 and check_nproc(1) == 1
    with pytest.raises(ValueError, match="1 process or 2"):
        check_nproc(3)
    with pytest.raises(ValueError, match="runs one process on one GPU"):
        check_nproc(2, "cuda")


def test_a_quick_table_in_this_process_leaves_compile_on_after_it(monkeypatch):
    """--nproc 1 runs the rows in the calling process: --quick's eager compile and optimizer are
    switched off again after it. (torch's public stance, not dynamo's config: a patch of
    ``torch._dynamo.config.disable`` hid the key for every later compile in the process.)"""
    import os

    import torch

    from kiln.bench.vit import _eager

    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    def double(x):
        return x * 2

    monkeypatch.delenv("KILN_OPTIM_EAGER", raising=False)  # (tests/test_optim.py sets it for its whole process)
    fn = torch.compile(double, backend=backend)
    with _eager(True):
        assert os.environ["KILN_OPTIM_EAGER"] == "1"
        assert fn(torch.ones(3)).tolist() == [2.0, 2.0, 2.0] and compiled == []
    assert "KILN_OPTIM_EAGER" not in os.environ
    with _eager(False):
        assert "KILN_OPTIM_EAGER" not in os.environ
        assert fn(torch.ones(3)).tolist() == [2.0, 2.0, 2.0] and len(compiled) == 1
    torch._dynamo.reset()


def test_a_gpu_s_rows_load_in_workers_unless_shared_memory_cannot_hold_their_batches(monkeypatch):
    from collections import namedtuple

    from kiln.bench import vit

    assert vit.loader_workers("cpu", SIZES["cpu"]) == (0, "")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(vit.shutil, "disk_usage", lambda path: usage(2**40, 0, 2**40))
    assert vit.loader_workers("cuda", SIZES["cuda"]) == ("auto", "")  # configs/vit_b16.py's
    monkeypatch.setattr(vit.shutil, "disk_usage", lambda path: usage(2**26, 0, 2**26))  # a container's 64 MB
    workers, why = vit.loader_workers("cuda", SIZES["cuda"])
    assert workers == 0 and why.startswith("data.workers=0: /dev/shm has 64 MB free")


# the GPU table's model and data (configs/vit_b16.py: 3 channels, 1000 classes), shrunk to run here
TINY_B16 = {"model.image_size": 32, "data.args.image_size": 32, "model.patch_size": 8, "model.dim": 32,
            "model.depth": 1, "model.heads": 2, "data.args.num_samples": 256, "data.args.val_samples": 32,
            "optim.schedule": "constant"}


@pytest.mark.e2e  # eight kiln train runs of 16 steps in this process: 30-40 s on the 2 shared cores (load 7)
def test_the_gpu_table_runs_in_one_process_on_a_cpu_at_tiny_sizes(tmp_path):
    """What `kiln bench vit --device cuda` runs, the ViT-B/16 config with the GPU's steps and rows,
    in one process, at a tiny width, image size and batch, on the CPU (there is no GPU here)."""
    import dataclasses

    from kiln.bench import vit

    sizes = dataclasses.replace(SIZES["cuda"], quick_keys=TINY_B16, batch=32, large_batch=64)
    report = vit.run(tmp_path, quick=True, device="cpu", nproc=1, sizes=sizes)
    assert report["setup"]["processes"] == 1 and report["setup"]["config"] == "configs/vit_b16.py"
    r = report["rows"]
    assert [row["name"] for row in r] == [row["name"] for row in rows(True, "cuda", 1, sizes)]
    assert r[2]["skipped"].startswith("not applicable") and r[2]["samples_per_s"] is None and r[2]["speedup"] is None
    assert "not applicable on one device" in (tmp_path / "vit.txt").read_text()
    for row in r[:2] + r[3:]:
        assert row["samples_per_s"] > 0 and row["peak_mb"] > 0, row["name"]
        assert row["config"]["train.compile"] == (row["name"] == "+ torch.compile"), row["name"]
        assert row["config"]["parallel.zero"] == 0 and row["config"]["train.device"] == "cpu"
        assert row["steps"] == (8 if row["config"]["data.batch_size"] == 64 else 16), row["name"]
    assert r[3]["vs_previous"] == pytest.approx(r[3]["samples_per_s"] / r[1]["samples_per_s"])  # over row 2


@pytest.mark.distributed  # nine kiln train runs in 2 gloo processes: 136-249 s on the 2 shared cores (load 11-23)
def test_vit_benchmark_quick(tmp_path):
    assert "vit" in BENCHMARKS
    report = run_benchmark("vit", tmp_path, quick=True)
    assert json.loads((tmp_path / "vit.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "vit.png").stat().st_size > 0
    assert "machine:" in (tmp_path / "vit.txt").read_text()
    assert report["machine"]["cpu_capability"] and report["setup"]["processes"] == 2
    table = rows(quick=True)
    assert [r["name"] for r in report["rows"]] == [r["name"] for r in table]
    for row, claimed in zip(report["rows"], table):
        # the config the run was built from (read back inside the run), not the one asked for
        assert {k: row["config"][k] for k in claimed["keys"] if k in row["config"]} == \
            {k: v for k, v in claimed["keys"].items() if k in row["config"]}, row["name"]
        assert row["config"]["train.threads"] == 1
        for key in ("samples_per_s", "speedup", "peak_mb"):
            assert row[key] > 0, (row["name"], key, row[key])
        assert len(row["peak_mb_per_rank"]) == 2
        assert 0.0 <= row["accuracy"] <= 1.0 and row["steps"] == claimed["keys"]["train.max_steps"]
    assert report["rows"][0]["speedup"] == 1.0
    # Numerically neutral techniques train the same model from the same weights on the same
    # samples, rounding aside: FSDP (row 3) and kiln's multi-tensor AdamW (row 4) against
    # row 2, batch-second tokens (row 6) against row 5. (AMP, the pooled classifier, the
    # larger batch and bf16-true change the numbers on purpose.)
    r = report["rows"]
    for i, j in ((2, 1), (3, 1), (5, 4)):
        assert abs(r[i]["eval_loss"] - r[j]["eval_loss"]) <= 2e-3 * r[j]["eval_loss"], (r[i]["name"], r[j]["name"])
        assert abs(r[i]["accuracy"] - r[j]["accuracy"]) <= 2 / 297 + 1e-9, (r[i]["name"], r[j]["name"])
    # and the check can tell: another model (the pooled classifier) is further apart than that
    assert abs(r[4]["eval_loss"] - r[3]["eval_loss"]) > 2e-3 * r[3]["eval_loss"]


# -- optim.impl: the baseline's torch.optim.AdamW through the config --------------------------------
def test_optim_impl_builds_torch_optimizers():
    import torch

    from kiln.config import load_config
    from kiln.models import create_model
    from kiln.train._build import build_optimizer

    model = create_model("vit", depth=1)
    for impl, flags in (("torch-forloop", dict(foreach=False, fused=None)), ("torch-foreach", dict(foreach=True)),
                        ("torch-fused", dict(fused=True))):
        cfg = load_config("configs/digits_vit.py", [f"optim.impl={impl}"])
        opt = build_optimizer(cfg.optim, model)
        assert type(opt) is torch.optim.AdamW
        for group in opt.param_groups:
            assert {k: group[k] for k in flags} == flags and group["lr"] == cfg.optim.lr
        # the same groups as kiln's: no decay for biases and norm weights, the config's decay otherwise
        assert [g["weight_decay"] for g in opt.param_groups] == [cfg.optim.weight_decay, 0.0]
    cfg = load_config("configs/digits_vit.py", ["optim.impl=torch-forloop", "optim.name=sgd", "optim.momentum=0.9"])
    opt = build_optimizer(cfg.optim, model)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    assert type(build_optimizer(load_config("configs/digits_vit.py").optim, model)).__module__.startswith("kiln.")


@pytest.mark.parametrize("overrides, words", [
    (["optim.impl=torch-forloop", "optim.name=lamb"], ["optim.impl=torch-forloop", "no lamb", "optim.impl=kiln"]),
    (["optim.impl=torch-foreach", "train.precision=bf16-true"], ["bf16-true", "arena", "optim.impl=kiln"]),
    (["optim.impl=torch-fused", "parallel.zero=2"], ["parallel.zero=2", "optim.impl=kiln"]),
    (["optim.impl=apex"], ["optim.impl"]),
])
def test_optim_impl_refuses_what_torch_optimizers_cannot_do(overrides, words):
    from kiln.config import load_config
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config("configs/digits_vit.py", overrides)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.distributed  # four kiln train runs in one pair of gloo processes
def test_torch_forloop_adamw_trains_under_ddp_and_fsdp(tmp_path):
    """Two processes with torch.optim.AdamW (for-loop), replicated and under FSDP2, step the
    same weights as kiln's AdamW from the same start (rounding aside); the four runs share one
    pair of processes (tests/group_runs.py), as the benchmark's rows do."""
    from group_runs import train_in_one_group

    from kiln.bench.vit import CONFIG
    from kiln.train import read_metrics

    cases = [(impl, zero) for impl in ("torch-forloop", "kiln") for zero in (0, 3)]
    runs = [(str(CONFIG), [f"optim.impl={impl}", f"parallel.zero={zero}", "train.precision=fp32", "train.max_steps=6",
                           "train.log_every=1", "train.progress=none", "train.threads=1",
                           f"train.output_dir={tmp_path / f'{impl}-{zero}'}", "optim.schedule=constant",
                           "model.depth=1"]) for impl, zero in cases]
    losses = {case: [float(r["train_loss"]) for r in read_metrics(run_dir) if r.get("train_loss")]
              for case, run_dir in zip(cases, train_in_one_group(2, runs))}
    base = losses["kiln", 0]
    assert len(base) == 6 and base[-1] < base[0]
    for key, got in losses.items():
        assert got == pytest.approx(base, rel=1e-4), key
