"""Users' own code in configs: functions defined in a config file or in a module beside it
(file targets), nested LazyCalls, data set builders, losses, metrics and collate functions,
and configs saved with them that load again from another working directory."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln.config._lazy as lazy
from kiln.config import (ConfigError, InstantiateError, LazyCall, build_callable, instantiate, load_config, locate,
                         save_config, target_path, validate)
from kiln.models import create_model

ROOT = Path(__file__).resolve().parents[1]

# A module of the user's: a model with a dataclass config, a loss, a metric class, a data set
# builder and a collate function.
TOY = '''
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset


@dataclass
class ToyCfg:
    width: int = 4
    scale: float = 1.0


class Toy(nn.Module):
    def __init__(self, cfg: ToyCfg, blocks: list | None = None):
        super().__init__()
        self.cfg = cfg
        self.inp = nn.Linear(cfg.width, 2)
        self.blocks = nn.ModuleList(blocks or [])

    def forward(self, x):
        return self.inp(x)


def scaled_loss(outputs, batch, scale: float = 1.0):
    return (outputs - batch[1]).abs().mean() * scale


class Hits:
    def __init__(self, tol: float = 0.5):
        self.tol = tol

    def __call__(self, outputs, batch):
        return ((outputs - batch[1]).abs() < self.tol).float().mean()


class NotCallable:
    def __init__(self, k: int = 1):
        self.k = k


def datasets(n: int, noise: float = 0.0, seed: int = 0):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x + noise), TensorDataset(x[:2], x[:2])


def collate(samples, scale: float = 1.0):
    xs, ys = zip(*samples)
    return torch.stack(xs) * scale, torch.stack(ys)


def points(width: int, n: int = 16):
    # (n, width) inputs and one of 2 classes each: what Toy(width) trains on (kiln plan runs its step)
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:4], y[:4])
'''


@pytest.fixture(autouse=True)
def _import_state(tmp_path):
    """Each test's modules, sys.path entries and users' directories go when it ends (module
    names are unique per test anyway, so that no test finds another's module by name)."""
    path, dirs = list(sys.path), set(lazy._USER_DIRS)
    yield
    _forget(tmp_path)
    sys.path[:] = path
    lazy._USER_DIRS.clear()
    lazy._USER_DIRS.update(dirs)


def _forget(tmp_path: Path) -> None:
    """What a fresh process would not have: the modules imported from under ``tmp_path``, and
    its directories on sys.path."""
    root = str(tmp_path.resolve())
    installed = (sys.prefix, sys.base_prefix)  # torch's, transformers'... thousands, none under tmp_path
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not file.startswith(installed) and os.path.realpath(file).startswith(root):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not os.path.realpath(p or ".").startswith(root)]
    lazy._USER_DIRS.difference_update({d for d in lazy._USER_DIRS if d.startswith(root)})


def _toy(directory: Path) -> str:
    """Write the TOY module into ``directory`` under a name unique to this test; its name."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"toy_{uuid.uuid4().hex[:8]}"
    (directory / f"{name}.py").write_text(TOY)
    return name


def _config(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # the L import goes after a __future__ import, which must stay the file's first statement
    before, future, rest = body.lstrip().rpartition("from __future__ import annotations\n")
    path.write_text(f"{before}{future}from kiln.config import LazyCall as L\n{rest}")
    return path


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- targets


def test_builder_defined_in_the_config_file(tmp_path):
    path = _config(tmp_path / "cfg.py", """
from __future__ import annotations
from dataclasses import dataclass
from torch import nn

@dataclass
class Widths:  # a dataclass in the config: it needs the config to be a registered module
    hidden: int = 5

def build_net(width: int, hidden: Widths):
    return nn.Sequential(nn.Linear(width, hidden.hidden), nn.Linear(hidden.hidden, 2))

model = L(build_net)(width=3, hidden=L(Widths)(hidden=7))
train = dict(max_steps=1)
""")
    cfg = load_config(path)
    assert cfg.model._target_ == f"{path.resolve()}:build_net"
    assert cfg.model.hidden._target_ == f"{path.resolve()}:Widths"
    net = instantiate(cfg.model)
    assert [m.in_features for m in net] == [3, 7] and net[1].out_features == 2


def test_module_beside_the_config_imports_from_another_working_directory(tmp_path, monkeypatch):
    cfgs = tmp_path / "cfgs"
    toy = _toy(cfgs)
    path = _config(cfgs / "cfg.py", f"from {toy} import Toy, ToyCfg\nmodel = L(Toy)(cfg=L(ToyCfg)(width=3))\n"
                                    "train = dict(max_steps=1)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    # the module is found only through the config's directory: named by its file
    assert cfg.model._target_ == f"{(cfgs / toy).resolve()}.py:Toy"
    model = instantiate(cfg.model)
    assert type(model) is sys.modules[toy].Toy  # the module the config imported, not a second copy
    assert str(cfgs.resolve()) in sys.path  # kept: the run builds the model after loading


def test_dotted_paths_are_unchanged():
    assert ":" not in target_path(create_model) and locate(target_path(create_model)) is create_model
    assert target_path(nn.Linear) == "torch.nn.Linear"
    assert locate("kiln.models.create_model") is create_model
    assert locate("torch.nn.Linear.forward") is nn.Linear.forward  # an attribute of a class
    with pytest.raises(ImportError, match="No module named 'no_such_pkg'"):
        locate("no_such_pkg.mod.fn")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        locate("kiln.models.nope")


def test_a_single_name_says_how_to_name_a_function():
    with pytest.raises(ImportError) as info:
        locate("build_gpt2")
    assert "package.module.function" in str(info.value)
    assert "define the function in the config file or a module beside it" in str(info.value)


def test_a_module_that_fails_to_import_is_reported_as_such(tmp_path, monkeypatch):
    name = f"bad_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        locate(f"{name}.Thing")
    # the module's own import failed: say so, rather than "no module named <the module>"
    assert f"importing {name} failed" in str(info.value) and "no_such_dependency_xyz" in str(info.value)


def test_lambdas_and_nested_functions_are_refused_where_they_are_passed():
    with pytest.raises(TypeError, match="top level"):
        LazyCall(lambda: None)


def test_file_target_imports_the_file_and_its_neighbours_in_a_fresh_process(tmp_path):
    # a package beside the config, with a relative import: imported under its package name
    pkg = f"pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "util.py").write_text("K = 3\n")
    (tmp_path / pkg / "layers.py").write_text("from .util import K\n\ndef width():\n    return K\n")
    target = f"{tmp_path / pkg / 'layers.py'}:width"
    assert locate(target)() == 3
    assert sys.modules[f"{pkg}.layers"].width is locate(target)  # found again, not imported twice
    # a plain file whose own imports need its directory on sys.path
    toy = _toy(tmp_path / "models")
    net = tmp_path / "models" / "net.py"
    net.write_text(f"from {toy} import ToyCfg\n\ndef make():\n    return ToyCfg(width=9)\n")
    assert locate(f"{net}:make")().width == 9
    assert target_path(locate(f"{net}:make")) == f"{net.resolve()}:make"


def test_a_missing_file_is_an_import_error_naming_it(tmp_path):
    with pytest.raises(ImportError, match=str(tmp_path / "gone.py")):
        locate(f"{tmp_path / 'gone.py'}:Net")


# --------------------------------------------------------------------------- nested nodes


def test_nested_lazycall_and_lists_of_nodes_validate_and_build(tmp_path):
    toy = _toy(tmp_path)
    lazy.add_user_dir(tmp_path)
    module = __import__(toy)
    tree = {"model": LazyCall(module.Toy)(cfg=LazyCall(module.ToyCfg)(width=3, scale=2),
                                          blocks=[LazyCall(nn.Linear)(in_features=2, out_features=2),
                                                  LazyCall(nn.ReLU)()]),
            "train": {"max_steps": 1}}
    checked = validate(tree)["model"]
    # the nested node is checked against its own target (scale: float), never coerced by Toy's
    # annotation of cfg (which would read it as ToyCfg's fields and refuse _target_)
    assert checked["cfg"] == {"_target_": f"{(tmp_path / toy).resolve()}.py:ToyCfg", "width": 3, "scale": 2.0}
    assert isinstance(checked["cfg"]["scale"], float)
    model = instantiate(checked)
    assert isinstance(model.cfg, module.ToyCfg) and model.cfg.width == 3 and model.inp.in_features == 3
    assert [type(b) for b in model.blocks] == [nn.Linear, nn.ReLU]


def test_nested_errors_name_the_key(tmp_path):
    toy = _toy(tmp_path)
    lazy.add_user_dir(tmp_path)
    module = __import__(toy)
    L = LazyCall

    def error(model) -> str:
        with pytest.raises(ConfigError) as info:
            validate({"model": model, "train": {"max_steps": 1}})
        assert "\n" not in str(info.value)
        return str(info.value)

    msg = error(L(module.Toy)(cfg=L(module.ToyCfg)(widht=3)))
    assert "unknown key model.cfg.widht; did you mean model.cfg.width?" in msg
    msg = error(L(module.Toy)(cfg=L(module.ToyCfg)(),
                              blocks=[L(nn.ReLU)(), L(nn.Linear)(in_featurs=2, out_features=2)]))
    assert "model.blocks[1].in_featurs" in msg and "model.blocks[1].in_features" in msg
    msg = error(L(module.Toy)(cfg={"_target_": "nope_pkg_xyz.Cfg"}))
    assert "model.cfg._target_='nope_pkg_xyz.Cfg' cannot be imported" in msg and "No module named 'nope_pkg_xyz'" in msg
    msg = error(L(module.Toy)())
    assert "model.cfg is missing" in msg
    msg = error(L(module.Toy)(cfg=L(module.ToyCfg)(width="x")))
    assert "model.cfg.width='x'" in msg and "int" in msg


def test_a_file_target_whose_file_is_gone(tmp_path):
    toy = _toy(tmp_path / "models")
    path = tmp_path / "cfg.yaml"
    path.write_text(f"model: {{_target_: '{tmp_path / 'models' / toy}.py:Toy', cfg: {{_target_: "
                    f"'{tmp_path / 'models' / toy}.py:ToyCfg'}}}}\ntrain: {{max_steps: 1}}\n")
    assert load_config(path).model.cfg._target_.endswith(":ToyCfg")
    _forget(tmp_path)
    (tmp_path / "models" / f"{toy}.py").unlink()
    msg = _error(path)
    assert f"model._target_='{tmp_path / 'models' / toy}.py:Toy' cannot be imported" in msg
    assert "does not exist" in msg


# --------------------------------------------------------------------------- data targets


def test_data_target_splits_its_arguments_from_the_loader_keys(tmp_path):
    toy = _toy(tmp_path)
    path = _config(tmp_path / "cfg.py", f"from {toy} import Toy, ToyCfg, datasets\n"
                   "model = L(Toy)(cfg=L(ToyCfg)())\n"
                   "data = L(datasets)(n=10, noise=1, batch_size=2, workers=0)\ntrain = dict(max_steps=1)\n")
    data = load_config(path).data
    assert data._target_.endswith(f"{toy}.py:datasets")
    assert data.n == 10 and data.noise == 1.0 and isinstance(data.noise, float)  # the target's, typed
    assert data.batch_size == 2 and data.workers == 0 and data.pin_memory == "auto"  # the loader's
    assert "name" not in data and "args" not in data and "seed" not in data
    assert set(data) == {"_target_", "n", "noise", "batch_size", "eval_batch_size", "workers", "pin_memory",
                         "persistent_workers", "prefetch_factor", "drop_last", "collate_fn", "task"}
    train, val = instantiate({k: v for k, v in data.items() if k in ("_target_", "n", "noise")})
    assert len(train) == 10 and len(val) == 2

    assert "a data._target_ replaces data.name/data.args" in _error(path, ["data.name=digits"])
    assert "data.args" in _error(path, ["data.args={n: 3}"])
    assert "train.seed" in _error(path, ["data.seed=3"])
    assert "did you mean data.batch_size?" in _error(path, ["data.batch_sise=4"])  # the loader's keys suggested too
    assert "unknown key data.nosie; did you mean data.noise?" in _error(path, ["data.nosie=1"])
    assert "data.n is missing" in _error(_config(tmp_path / "no_n.py", f"from {toy} import datasets, Toy, ToyCfg\n"
                                                 "model = L(Toy)(cfg=L(ToyCfg)())\ndata = L(datasets)()\n"
                                                 "train = dict(max_steps=1)\n"))
    assert load_config(path, ["data.n=4"]).data.n == 4


def test_registered_data_sets_are_unchanged():
    cfg = load_config(ROOT / "configs" / "digits_vit.py")
    assert cfg.data.name == "digits" and "_target_" not in cfg.data and cfg.data.collate_fn is None


# --------------------------------------------------------------------------- loss, metrics, collate


def test_loss_metrics_and_collate_are_validated(tmp_path):
    toy = _toy(tmp_path)
    path = _config(tmp_path / "cfg.py", f"""from {toy} import Toy, ToyCfg, scaled_loss, Hits, collate
model = L(Toy)(cfg=L(ToyCfg)())
data = dict(collate_fn=L(collate)(scale=2))
train = dict(max_steps=1, loss=L(scaled_loss)(scale=3), metrics={{"hits": L(Hits)(tol=1)}})
""")
    cfg = load_config(path)
    assert cfg.train.loss == {"_target_": f"{(tmp_path / toy).resolve()}.py:scaled_loss", "scale": 3.0}
    assert cfg.train.metrics.hits.tol == 1.0 and cfg.data.collate_fn.scale == 2.0

    def err(*overrides: str) -> str:
        msg = _error(path, overrides)
        assert "\n" not in msg
        return msg

    assert "unknown key train.loss.scal; did you mean train.loss.scale?" in err("train.loss.scal=1")
    assert "fn(outputs, batch, **kwargs)" in err("train.loss=builtins.len")  # one positional argument
    assert "train.loss.input: kiln passes" in err("train.loss={_target_: torch.nn.functional.l1_loss, input: 1}")
    assert "train.metrics.hits.tol='a'" in err("train.metrics.hits.tol=a")
    assert f"instances of {(tmp_path / toy).resolve()}.py:NotCallable are not callable" in err(
        f"train.metrics.hits={(tmp_path / toy).resolve()}.py:NotCallable")
    with pytest.raises(ConfigError, match="train.metrics name 'f 1' must be an identifier"):
        validate({"model": {"name": "mlp"}, "train": {"max_steps": 1, "metrics": {"f 1": "operator.sub"}}})
    assert "train.metrics.loss" in err("train.metrics.loss=operator.add")
    assert "must map names to metrics" in err("train.metrics={_target_: operator.add}")
    assert "train.loss='no_pkg_xyz.f' cannot be imported" in err("train.loss=no_pkg_xyz.f")
    assert "unknown key data.collate_fn.scal" in err("data.collate_fn.scal=1")
    assert "must be an import path" in err("train.loss=3")
    # overrides by path, dotted or to a file
    cfg = load_config(path, ["train.loss=torch.nn.functional.l1_loss", "data.collate_fn=null",
                             f"train.metrics.hits={(tmp_path / toy).resolve()}.py:scaled_loss"])
    assert cfg.train.loss == "torch.nn.functional.l1_loss" and cfg.data.collate_fn is None
    assert cfg.train.metrics.hits.endswith(":scaled_loss")


def test_a_function_object_in_a_python_config_becomes_its_path(tmp_path):
    path = _config(tmp_path / "cfg.py", "import operator\nmodel = dict(name='mlp')\n"
                   "train = dict(max_steps=1, loss=operator.sub, metrics=dict(diff=operator.sub))\n")
    cfg = load_config(path)
    assert locate(cfg.train.loss) is __import__("operator").sub
    assert cfg.train.metrics.diff == cfg.train.loss


def test_early_stopping_takes_the_configured_metrics(tmp_path):
    path = _config(tmp_path / "cfg.py", "model = dict(name='mlp')\n"
                   "train = dict(max_steps=1, eval_every=1, metrics={'diff': 'operator.sub'})\n")
    assert load_config(path, ["train.early_stopping={metric: eval_diff}"]).train.early_stopping.metric == "eval_diff"
    assert "eval_loss, eval_diff" in _error(path, ["train.early_stopping={metric: eval_accuracy}"])


def test_build_callable():
    assert build_callable(None) is None
    assert build_callable("operator.sub") is __import__("operator").sub
    fn = build_callable({"_target_": "torch.nn.functional.l1_loss", "reduction": "sum"})
    assert isinstance(fn, functools.partial) and fn.keywords == {"reduction": "sum"}
    assert fn(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])).item() == 3.0  # runtime args first
    # kwargs are built first: a node inside is the object it describes
    fn = build_callable({"_target_": "math.isclose", "rel_tol": {"_target_": "fractions.Fraction", "numerator": 1,
                                                                     "denominator": 2}})
    assert fn(1.0, 1.9) and not fn(1.0, 2.1)
    loss = build_callable({"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1})
    assert isinstance(loss, nn.CrossEntropyLoss) and loss.label_smoothing == 0.1  # a class: its instance
    assert isinstance(build_callable("torch.nn.MSELoss"), nn.MSELoss)
    from omegaconf import OmegaConf

    fn = build_callable(OmegaConf.create({"_target_": "math.isclose", "abs_tol": 1}))
    assert fn(2, 2.5) and not fn(2, 3.5)


def test_instantiate_builds_inside_out():
    from omegaconf import OmegaConf

    node = {"_target_": "builtins.dict", "a": [{"_target_": "fractions.Fraction", "numerator": 2, "denominator": 4}, 5],
            "b": {"plain": {"_target_": "fractions.Fraction", "numerator": 3}}}
    from fractions import Fraction

    assert instantiate(node) == {"a": [Fraction(1, 2), 5], "b": {"plain": Fraction(3)}}
    assert instantiate(OmegaConf.create(node)) == {"a": [Fraction(1, 2), 5], "b": {"plain": Fraction(3)}}
    assert instantiate(OmegaConf.create([{"_target_": "fractions.Fraction", "numerator": 1}])) == [Fraction(1)]
    failed = r"building fractions.Fraction \(at a\[0\]\) failed: ZeroDivisionError"
    with pytest.raises(InstantiateError, match=failed) as info:
        instantiate({"a": [{"_target_": "fractions.Fraction", "numerator": 1, "denominator": 0}]})
    assert isinstance(info.value.__cause__, ZeroDivisionError)


# --------------------------------------------------------------------------- saved configs


def test_saved_config_with_file_targets_loads_from_another_directory(tmp_path, monkeypatch):
    cfgs = tmp_path / "cfgs"
    toy = _toy(cfgs)
    path = _config(cfgs / "cfg.py", f"""from {toy} import Toy, ToyCfg, scaled_loss

def build(width: int = 3):  # defined in the config, using the module beside it
    return Toy(ToyCfg(width=width))

def double_loss(outputs, batch, scale: float = 1.0):
    return scaled_loss(outputs, batch, 2 * scale)

model = L(build)(width=5)
train = dict(max_steps=1, loss=L(double_loss)(scale=1.5), metrics={{"l1": L(scaled_loss)()}})
""")
    cfg = load_config(path)
    save_config(cfg, tmp_path / "config.yaml")
    _forget(tmp_path)  # as in a new process: none of the user's modules, none of their directories
    assert toy not in sys.modules
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    model = instantiate(again.model)
    assert model.inp.in_features == 5 and type(model) is sys.modules[toy].Toy  # one copy of the module
    loss = build_callable(again.train.loss)
    out, batch = torch.ones(2, 2), (None, torch.zeros(2, 2))
    assert loss(out, batch).item() == 3.0 and build_callable(again.train.metrics.l1)(out, batch).item() == 1.0


# --------------------------------------------------------------------------- the command line


def _kiln(launcher: str) -> list[str]:
    if launcher == "script":  # the console script: no working directory on sys.path
        return [shutil.which("kiln") or str(Path(sys.executable).with_name("kiln"))]
    return [sys.executable, "-m", "kiln"]


def _plan(tmp_path: Path, launcher: str, config: Path) -> str:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([*_kiln(launcher), "plan", str(config)], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("launcher", ["script", "module"])
def test_kiln_plan_builds_users_code_from_another_directory(tmp_path, launcher):
    toy = _toy(tmp_path / "cfgs")
    path = _config(tmp_path / "cfgs" / "cfg.py", f"""from {toy} import Toy, ToyCfg, points

def build(width: int):
    return Toy(ToyCfg(width=width))

model = L(build)(width=6)
data = L(points)(width=6, batch_size=8, eval_batch_size=4)
train = dict(max_steps=1)
""")
    out = _plan(tmp_path, launcher, path)
    # Linear(6, 2): 12 weights + 2 biases
    assert f"{path.resolve()}:build: 14 parameters" in out


def _nested_config(tmp_path: Path) -> Path:
    toy = _toy(tmp_path / "cfgs")
    return _config(tmp_path / "cfgs" / "cfg.py", f"""from torch import nn
from {toy} import Toy, ToyCfg, points
model = L(Toy)(cfg=L(ToyCfg)(width=3), blocks=[L(nn.Linear)(in_features=2, out_features=2)])
data = L(points)(width=3, batch_size=8, eval_batch_size=4)
train = dict(max_steps=1)
""")


def _plan_here(tmp_path: Path, config: Path, capsys, monkeypatch) -> str:
    """kiln plan in this process, from another directory (what a launcher adds to sys.path is
    the test above's)."""
    from kiln.commands import main

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)
    assert main(["plan", str(config)]) == 0
    return capsys.readouterr().out


def test_kiln_plan_on_a_nested_lazycall(tmp_path, capsys, monkeypatch):
    # Linear(3, 2) + Linear(2, 2): 8 + 6 parameters
    assert ":Toy: 14 parameters" in _plan_here(tmp_path, _nested_config(tmp_path), capsys, monkeypatch)


def test_kiln_plan_on_a_saved_config_with_file_targets(tmp_path, capsys, monkeypatch):
    save_config(load_config(_nested_config(tmp_path)), tmp_path / "config.yaml")
    assert ":Toy: 14 parameters" in _plan_here(tmp_path, tmp_path / "config.yaml", capsys, monkeypatch)
