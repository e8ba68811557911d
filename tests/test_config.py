"""The config system: loading .py and .yaml, overrides, validation messages, save and reload."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.config import ConfigError, LazyCall, instantiate, load_config, save_config, validate
from kiln.models import create_model

ROOT = Path(__file__).resolve().parents[1]
VIT = ROOT / "configs" / "digits_vit.py"
MLP = ROOT / "configs" / "digits_mlp.yaml"


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_python_config_loads_with_defaults_filled_in():
    cfg = load_config(VIT)
    assert cfg.model.name == "vit" and cfg.model.dim == 64
    assert cfg.model.mlp_ratio == 4.0  # a model default the file did not write
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 2e-3 and cfg.optim.weight_decay == 0.5
    assert cfg.optim.eps is None  # not written: the optimizer's own default applies
    assert cfg.train.max_steps == 1000
    assert cfg.data.batch_size == 64
    assert cfg.parallel.dp is None
    assert set(cfg.keys()) == {"model", "data", "optim", "train", "parallel"}


def test_yaml_config_loads():
    cfg = load_config(MLP)
    assert cfg.model.name == "mlp" and list(cfg.model.hidden) == [256, 256]
    assert cfg.optim.schedule == "cosine"


def test_overrides_are_typed_and_dotted():
    cfg = load_config(VIT, ["train.max_steps=7", "optim.lr=1e-2", "optim.contiguous=false",
                            "model.depth=2", "optim.betas=[0.8,0.9]", "train.clip_grad_norm=null"])
    assert cfg.train.max_steps == 7 and isinstance(cfg.train.max_steps, int)
    assert cfg.optim.lr == 0.01 and cfg.optim.contiguous is False
    assert cfg.model.depth == 2
    assert list(cfg.optim.betas) == [0.8, 0.9]
    assert cfg.train.clip_grad_norm is None


def test_int_is_accepted_where_a_float_is_expected():
    cfg = load_config(VIT, ["optim.lr=1"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_unknown_key_names_it_and_suggests_the_closest():
    msg = _error(VIT, ["train.max_stepz=5"])
    assert "train.max_stepz" in msg and "did you mean train.max_steps?" in msg


def test_unknown_model_option_suggests_the_closest():
    msg = _error(VIT, ["model.dpeth=3"])
    assert "model.dpeth" in msg and "model.depth" in msg


def test_unknown_data_arg_is_rejected():
    assert "data.args.split_sed" in _error(VIT, ["data.args.split_sed=1"])


def test_wrong_type_names_key_and_expected_type():
    msg = _error(VIT, ["train.max_steps=abc"])
    assert "train.max_steps" in msg and "int" in msg
    msg = _error(VIT, ["optim.contiguous=3"])
    assert "optim.contiguous" in msg and "bool" in msg


def test_bool_is_not_an_int():
    assert "train.seed" in _error(VIT, ["train.seed=true"])


def test_choice_suggests_the_closest_value():
    msg = _error(VIT, ["optim.schedule=cosin"])
    assert "optim.schedule" in msg and "'cosine'" in msg
    msg = _error(VIT, ["optim.name=adamx"])  # a name the optimizer classes declare
    assert "optim.name" in msg and "did you mean adam?" in msg and "lamb, lars" in msg


def test_an_option_the_chosen_optimizer_does_not_take_is_refused():
    # the optimizer classes declare their options; before, momentum was silently dropped for AdamW
    msg = _error(VIT, ["optim.momentum=0.9"])
    assert "optim.momentum=0.9 is not an option of adamw" in msg and "sgd, lars" in msg
    assert "optim.betas" in _error(VIT, ["optim.name=sgd", "optim.betas=[0.9,0.95]"])
    assert "optim.nesterov" in _error(VIT, ["optim.nesterov=true"])
    cfg = load_config(VIT, ["optim.name=sgd", "optim.momentum=0.9", "optim.nesterov=true"])
    assert cfg.optim.momentum == 0.9


def test_unknown_namespace_in_override_and_in_file(tmp_path):
    msg = _error(VIT, ["trian.max_steps=5"])
    assert "'trian'" in msg and "did you mean train" in msg
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: mlp}\noptimizer: {lr: 0.1}\ntrain: {max_steps: 1}\n")
    msg = _error(path)
    assert "'optimizer'" in msg and "optim" in msg


def test_missing_file_is_a_clear_error(tmp_path):
    msg = _error(tmp_path / "nope.yaml")
    assert "not found" in msg and "nope.yaml" in msg


def test_wrong_suffix(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    assert ".py, .yaml" in _error(path)


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: mlp\ntrain: {max_steps: 5\n")
    msg = _error(path)
    assert "malformed YAML" in msg and "bad.yaml" in msg and "line" in msg


def test_python_config_that_raises_is_reported(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("model = dict(name='mlp')\nraise RuntimeError('oops')\n")
    msg = _error(path)
    assert "boom.py" in msg and "oops" in msg


def test_missing_model_and_missing_length(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {max_steps: 3}\n")
    assert "model.name" in _error(path)
    path.write_text("model: {name: mlp}\n")
    assert "train.max_steps or train.epochs" in _error(path)


def test_model_geometry_is_checked_before_building():
    msg = _error(VIT, ["model.heads=5"])
    assert "heads" in msg and "64" in msg


def test_batch_not_divisible_by_accumulation():
    msg = _error(VIT, ["data.batch_size=63", "train.accumulate=2"])
    assert "data.batch_size=63" in msg and "train.accumulate=2" in msg


def test_override_without_equals():
    assert "key=value" in _error(VIT, ["train.max_steps"])


def test_save_and_reload_is_identical(tmp_path):
    cfg = load_config(VIT, ["train.max_steps=11", "optim.betas=[0.9,0.95]"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_lazycall_builds_a_target_node_and_instantiates():
    node = LazyCall(create_model)(name="mlp", hidden=[8], in_features=4, num_classes=3)
    assert node["_target_"].endswith("create_model")
    model = instantiate(node)
    import torch

    assert model(torch.zeros(2, 4)).shape == (2, 3)


def test_foreign_target_is_checked_against_its_signature():
    tree = {"model": {"_target_": "torch.nn.Linear", "in_features": 4, "out_featurs": 2},
            "train": {"max_steps": 1}}
    with pytest.raises(ConfigError, match="out_features"):
        validate(tree)
    tree["model"] = {"_target_": "no.such.module.Thing"}
    with pytest.raises(ConfigError, match="cannot be imported"):
        validate(tree)


def test_precision_defaults_to_auto_and_lists_it():
    assert load_config(MLP).train.precision == "auto"  # resolved per device when the run is set up
    assert load_config(MLP, ["train.precision=fp32"]).train.precision == "fp32"
    msg = _error(MLP, ["train.precision=bf16"])
    assert "train.precision" in msg and "'auto'" in msg and "'bf16-mixed'" in msg


def test_train_compile_auto_compiles_on_a_gpu_only_and_never_under_a_pipeline(monkeypatch):
    """train.compile=auto becomes a bool when the config is read: true for train.device=cuda (or
    auto with CUDA present), false on a CPU, with parallel.pp > 1 or parallel.auto."""
    import torch

    from kiln.config import load_config

    gpt = str(Path(__file__).resolve().parents[1] / "configs" / "gpt_tiny.py")

    def compiled(*overrides: str) -> bool:
        return load_config(gpt, ["train.compile=auto", *overrides]).train.compile

    assert compiled("train.device=cpu") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compiled("train.device=auto") is True and compiled("train.device=cuda") is True
    assert compiled("train.device=cuda", "parallel.pp=2") is False
    assert compiled("train.device=cuda", "parallel.auto=true") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compiled("train.device=auto") is False
    assert load_config(gpt, []).train.compile is False  # the default stays off
