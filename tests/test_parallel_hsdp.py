"""HSDP (``parallel.replicate=R`` under ZeRO-3): the checks made before anything is built, every
rank's planned bytes (a group's share, not the whole dp's), and on gloo a 2 x 2 run that trains
as one process does and whose checkpoint resumes under FSDP2 over 2 ranks and in one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.models import create_model
from kiln.train import check_layout, load_checkpoint
from launched import kiln_here, max_rel, only_run

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
GPT = str(ROOT / "configs" / "gpt_tiny.py")


@pytest.mark.parametrize("overrides, nproc, message", [
    (["parallel.zero=2", "parallel.replicate=2"], None,
     "parallel.replicate=2 (HSDP) with parallel.zero=2 is not supported: HSDP shards with FSDP2; use parallel.zero=3"),
    (["parallel.replicate=2"], None, "parallel.replicate=2 (HSDP) shards within each replica group with FSDP2; set "
                                     "parallel.zero=3"),
    (["parallel.zero=3", "parallel.replicate=0"], None, "parallel.replicate=0 must be at least 1"),
    (["parallel.zero=3", "parallel.replicate=3"], 4,
     "parallel.replicate=3 must divide the data-parallel size parallel.dp=4; choose among 1, 2, 4"),
    (["parallel.zero=3", "parallel.replicate=2"], 2, "parallel.replicate=2 = parallel.dp leaves shard groups of one "
                                                     "rank"),
])
def test_a_replicate_that_cannot_apply_is_refused_in_one_line_before_anything_is_built(overrides, nproc, message):
    with pytest.raises(ConfigError) as info:
        check_layout(load_config(MLP, overrides), nproc) if nproc else load_config(MLP, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_layout_splits_dp_into_replicas_of_shard_groups():
    layout = check_layout(load_config(MLP, ["parallel.zero=3", "parallel.replicate=2"]), 8)
    assert (layout.dp, layout.replicate, layout.shard) == (8, 2, 4)
    assert str(layout) == "dp=8 (2 replicas x 4 shards) x tp=1 x pp=1"
    assert layout.as_json() == {"dp": 8, "tp": 1, "pp": 1, "replicate": 2}


@pytest.mark.e2e  # two traces of 4 and 8 ranks: 13-20 s on 2 shared cores
def test_plan_gives_each_rank_its_groups_share_of_the_model_states_with_tp_too():
    # traced on fake tensors through kiln train's own set-up: the mesh and FSDP2's shards are real
    from kiln.plan import plan

    common = ["train.precision=fp32", "model.depth=2", "parallel.zero=3"]
    n_params = sum(p.numel() for p in create_model("gpt", vocab_size=256, seq_len=64, dim=64, depth=2,
                                                   heads=4).parameters())
    kept = {}
    for key, nproc, extra in [("hsdp 2x2", 4, ["parallel.replicate=2"]),
                              ("hsdp 2x2 x tp2", 8, ["parallel.replicate=2", "parallel.tp=2"])]:
        planned = plan(load_config(GPT, [*common, *extra]), nproc)
        assert len(planned.ranks) == nproc
        kept[key] = planned.ranks[planned.fullest_rank].between_steps
    # FSDP2 over all 4 ranks would keep a quarter of the fp32 weights; HSDP 2 x 2 keeps a half (its
    # group's share), and with tp=2 a half of that again (DTensor's uneven shards: within 5%)
    assert kept["hsdp 2x2"]["parameters"] == pytest.approx(4 * n_params / 2, rel=0.05)
    assert kept["hsdp 2x2 x tp2"]["parameters"] == pytest.approx(4 * n_params / 4, rel=0.05)
    for key, shards in (("hsdp 2x2", 2), ("hsdp 2x2 x tp2", 4)):
        assert kept[key]["optimizer_state"] == pytest.approx(2 * 4 * n_params / shards, rel=0.05), key  # AdamW


# --- on gloo: 4 processes as 2 replicas x 2 shards ----------------------------------------------

_COMMON = ["train.max_steps=10", "train.checkpoint_every=5", "train.log_every=5", "train.eval_every=0",
           "optim.lr=1e-3", "optim.schedule=constant", "data.name=synthetic_images", "train.clip_grad_norm=1.0",
           "train.precision=fp32"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The HSDP 2 x 2 run (checkpoints at steps 5 and 10) and the one-process run of the same config."""
    out = tmp_path_factory.mktemp("hsdp")
    hsdp = kiln_here("train", MLP, "--nproc", "4", "parallel.zero=3", "parallel.replicate=2", *_COMMON,
                     f"train.output_dir={out / 'hsdp'}")
    assert hsdp.returncode == 0, hsdp.stderr[-2000:]
    one = kiln_here("train", MLP, *_COMMON, f"train.output_dir={out / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    return only_run(out / "hsdp"), only_run(out / "one")


def _compare(a: Path, b: Path) -> tuple[float, float]:
    ca, cb = load_checkpoint(a / "checkpoints" / "final"), load_checkpoint(b / "checkpoints" / "final")
    moments = {k: st["exp_avg"] for k, st in ca["optimizer"]["state"].items()}
    return max_rel(ca["model"], cb["model"]), max_rel(moments, {k: cb["optimizer"]["state"][k]["exp_avg"]
                                                                   for k in moments})


@pytest.mark.distributed
def test_hsdp_2x2_trains_the_same_model_as_one_process(runs):
    hsdp, one = runs
    summary = json.loads((hsdp / "summary.json").read_text())
    assert summary["processes"] == 4 and summary["layout"] == {"dp": 4, "tp": 1, "pp": 1, "replicate": 2}
    # each replica's gradient reduce-scattered within its group, then all-reduced across the two
    # groups: the mean over all four ranks' samples, as one process computes it (measured 3.4e-6)
    weights, moments = _compare(one, hsdp)
    assert weights < 1e-4 and moments < 1e-4
    assert summary["final_train_loss"] == pytest.approx(
        json.loads((one / "summary.json").read_text())["final_train_loss"], rel=1e-5)


@pytest.mark.distributed
def test_an_hsdp_checkpoint_resumes_under_fsdp2_on_two_ranks_and_in_one_process(runs, tmp_path):
    hsdp, one = runs
    for case, layout in enumerate([("--nproc", "2", "parallel.zero=3"), ("parallel.zero=0",)]):
        copy = tmp_path / f"resume-{case}"
        shutil.copytree(hsdp, copy)
        shutil.rmtree(copy / "checkpoints" / "final")  # as if stopped after step 5's save
        resumed = kiln_here("train", "--resume", str(copy), *layout, "parallel.replicate=1")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        summary = json.loads((copy / "summary.json").read_text())
        assert summary["steps"] == 10 and summary["processes"] == (2 if "--nproc" in layout else 1)
        assert summary["resumed"][-1]["from"].endswith("step-00000005")
        weights, moments = _compare(one, copy)
        assert weights < 1e-4 and moments < 1e-4, layout
