"""One way to build a run (STYLE 18, issue 40): kiln train's ``setup`` and kiln plan's dry run
build a rank through the same stage functions (``kiln.train.parts.STAGES``), in the same order,
and the step both run reads the same context type. The plan leaves out only the stages that
have no meaning in a dry run, and calls none of the builders the stages own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.plan import plan
from kiln.train import parts

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")

# the stages a dry run on fake tensors does not call: its fake process group stands in for
# joining one, train.precision=auto's measurement of speed, a checkpoint's state, the run directory
DRY_RUN_SKIPS = ("join", "settle_precision", "restore", "open_run_dir")


def _record(monkeypatch: pytest.MonkeyPatch, functions: tuple) -> list[tuple[str, str]]:
    """Every call of ``functions`` from now on, as ``(name, type of the first argument)``,
    however its caller imported it (each binding in kiln's modules is replaced)."""
    calls: list[tuple[str, str]] = []
    for function in functions:
        def recorded(*args, _function=function, **kwargs):
            calls.append((_function.__name__, type(args[0]).__name__ if args else ""))
            return _function(*args, **kwargs)

        bound = [(module, name) for module in list(sys.modules.values())
                 if getattr(module, "__name__", "").startswith("kiln")
                 for name, value in list(vars(module).items()) if value is function]
        assert bound, function
        for module, name in bound:
            monkeypatch.setattr(module, name, recorded)
    return calls


def test_kiln_plan_builds_a_rank_through_the_stages_kiln_train_calls(tmp_path, monkeypatch):
    cfg = load_config(MLP, ["train.precision=fp32", "train.max_steps=2", "train.progress=none",
                            "train.activation_checkpointing=full"])
    calls = _record(monkeypatch, (*parts.STAGES, parts.train_step))
    run = parts.setup(cfg, run_dir=tmp_path / "run")
    try:
        parts.train_step(run, next(run.batches))
    finally:
        run.progress.close()
        run.out.close()
    trained = [name for name, _ in calls]
    assert trained == [stage.__name__ for stage in parts.STAGES] + ["train_step"]

    calls.clear()
    planned = plan(cfg)
    assert planned.ranks[0].peak_bytes > 0
    stages = [name for name, _ in calls if name != "train_step"]
    assert stages == [name for name in trained[:-1] if name not in DRY_RUN_SKIPS]
    # two steps (the first on zero gradients), on the same context type kiln train's Run is one of
    steps = {first for name, first in calls if name == "train_step"}
    assert steps == {"StepContext"} and isinstance(run, parts.StepContext)


# what a rank is made of: called by setup's stages, never by the plan itself (a second build order)
BUILDERS = {"parallelize", "build_optimizer", "build_scheduler", "build_task", "apply_ac", "apply_chunked_head",
            "broadcast_parameters", "load_weights", "check_steps", "init_distributed", "Meter", "StepContext",
            "data_parallel", "attach"}


def test_the_planner_calls_no_builder_of_a_rank_outside_the_stages():
    called = []
    for path in sorted((ROOT / "kiln" / "plan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in BUILDERS:
                    called.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
    assert not called, called
    # the check sees calls, by name or attribute
    tree = ast.parse("parallelize(m)\npar.data_parallel(opt)")
    assert [getattr(n.func, "id", None) or n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)] == \
        ["parallelize", "data_parallel"]
