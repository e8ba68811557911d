"""train.loggers: TensorBoard, Weights & Biases (offline) and MLflow (a local file: store) each
get the config, every row of metrics.csv and the summary, read back here from what each wrote;
a resumed run continues the same logged run; a logger that fails never stops training."""

from __future__ import annotations

import json
import struct
import time
import warnings
from pathlib import Path

import pytest

from kiln.commands import main
from kiln.train import read_metrics
from kiln.train import _loggers
from launched import kiln_here

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
# 6 steps, a row every 2, evaluations at 3 and 6: rows at 2, 3, 4, 6
SHORT = ["train.max_steps=6", "train.log_every=2", "train.eval_every=3", "train.progress=none",
         "train.precision=fp32", "model.hidden=[32]"]


def _train(tmp_path: Path, *overrides: str) -> Path:
    assert main(["train", MLP, f"train.output_dir={tmp_path / 'runs'}", *SHORT, *overrides]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    return run


def _resume(run: Path, steps: int) -> None:
    assert main(["train", "--resume", str(run), f"train.max_steps={steps}"]) == 0


def _csv(run: Path) -> dict[int, dict[str, float]]:
    """metrics.csv's numbers, by step (written to 6 significant digits: compare with rel=1e-5)."""
    return {int(r["step"]): {k: float(v) for k, v in r.items() if k != "step" and v not in ("", None)}
            for r in read_metrics(run)}


def _same_rows(logged: dict[int, dict[str, float]], csv: dict[int, dict[str, float]]) -> None:
    assert sorted(logged) == sorted(csv)
    for step, row in csv.items():
        assert logged[step] == pytest.approx(row, rel=1e-5), step


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


# ----------------------------------------------------------------------------- Weights & Biases


def _wandb_records(path: Path):
    """The records of an offline W&B run file (``run-ID.wandb``): LevelDB's log format, blocks of
    32 KiB holding chunks (4-byte checksum, 2-byte length, 1-byte type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, chunks = 7, b""  # after the file's header
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _wandb_run(run_file: Path) -> dict:
    """What one offline W&B run file holds: its id, config, history rows by step, and summary.
    W&B's service writes the file after finish() returns: this waits for its exit record."""
    from google.protobuf.message import DecodeError

    def records() -> list:
        try:
            return list(_wandb_records(run_file))
        except DecodeError:  # a record the service is still writing
            return []

    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in records()):
        assert time.monotonic() < deadline, f"{run_file} has no exit record after 60 s"
        time.sleep(0.05)
    out = {"id": None, "config": {}, "history": {}, "summary": {}}

    def items(entries) -> dict:  # W&B's own keys (_step, _runtime, _wandb) left out
        named = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in entries}
        return {k: v for k, v in named.items() if k and (k == "_step" or not k.startswith("_"))}

    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["config"].update(items(record.run.config.update))
        elif kind == "config":
            out["config"].update(items(record.config.update))
        elif kind == "history":
            row = items(record.history.item)
            out["history"][row.pop("_step")] = row
        elif kind == "summary":
            out["summary"].update(items(record.summary.update))
    return out


def test_wandb_offline_gets_config_metrics_and_summary_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "kiln-test")
    run = _train(tmp_path, "train.loggers=[csv,wandb]")
    (first,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    logged = _wandb_run(first)
    saved = json.loads((run / "loggers.json").read_text())["wandb"]
    assert saved == {"id": logged["id"], "project": "kiln-test"}
    assert logged["config"]["optim"]["lr"] == 0.003 and logged["config"]["train"]["max_steps"] == 6
    csv = _csv(run)
    assert sorted(csv) == [2, 3, 4, 6]
    _same_rows(logged["history"], csv)
    summary = _summary(run)
    assert logged["summary"]["final_train_loss"] == summary["final_train_loss"]
    assert logged["summary"]["eval"] == pytest.approx(summary["eval"]) and logged["summary"]["status"] == "completed"

    _resume(run, 8)
    runs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2  # W&B keeps the resumed part apart on disk, under the same run id
    again = _wandb_run(next(p for p in runs if p != first))
    assert again["id"] == logged["id"] and json.loads((run / "loggers.json").read_text())["wandb"] == saved
    assert sorted(again["history"]) == [8] and again["history"][8] == pytest.approx(_csv(run)[8], rel=1e-5)
    assert again["config"]["train"]["max_steps"] == 8
    assert again["summary"]["steps"] == 8


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_file_store_gets_config_metrics_and_summary_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to use a file: store
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kiln-test")
    run = _train(tmp_path, "train.loggers=[csv,mlflow]")
    saved = json.loads((run / "loggers.json").read_text())["mlflow"]
    assert saved["tracking_uri"] == store
    client = MlflowClient(tracking_uri=store)
    logged = client.get_run(saved["run_id"])
    assert logged.info.run_name == run.name and logged.info.status == "FINISHED"
    assert client.get_experiment(logged.info.experiment_id).name == "kiln-test"
    params = logged.data.params
    assert params["optim.lr"] == "0.003" and params["train.max_steps"] == "6" and params["model.hidden"] == "[32]"

    def history() -> dict[int, dict[str, float]]:
        rows: dict[int, dict[str, float]] = {}
        for key in client.get_run(saved["run_id"]).data.metrics:
            for m in client.get_metric_history(saved["run_id"], key):
                rows.setdefault(m.step, {})[key] = m.value
        return rows

    _same_rows(history(), _csv(run))
    artifacts = Path(client.download_artifacts(saved["run_id"], "", str(tmp_path / "got")))
    assert json.loads((artifacts / "summary.json").read_text()) == _summary(run)
    assert (artifacts / "config.yaml").read_text() == (run / "config.yaml").read_text()

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'elsewhere'}")  # the resume finds its store
    _resume(run, 8)
    assert json.loads((run / "loggers.json").read_text())["mlflow"] == saved
    assert client.get_run(saved["run_id"]).info.status == "FINISHED"
    _same_rows(history(), _csv(run))
    assert max(_csv(run)) == 8
    artifacts = Path(client.download_artifacts(saved["run_id"], "", str(tmp_path / "got-again")))
    assert json.loads((artifacts / "summary.json").read_text())["steps"] == 8
    assert "max_steps: 8" in (artifacts / "config.yaml").read_text()
    assert not (tmp_path / "elsewhere").exists()


# ----------------------------------------------------------------------------- TensorBoard


def test_tensorboard_gets_the_metrics_config_and_summary(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _train(tmp_path, "train.loggers=[csv,tensorboard]")
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    csv = _csv(run)
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert loss == pytest.approx({s: r["train_loss"] for s, r in csv.items() if "train_loss" in r}, rel=1e-5)
    assert [e.step for e in events.Scalars("eval/accuracy")] == [3, 6]
    texts = {tag: events.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]
             if tag.endswith("text_summary")}
    assert '"lr": 0.003' in texts["config/text_summary"]
    assert f'"final_train_loss": {_summary(run)["final_train_loss"]}' in texts["summary/text_summary"]


# ----------------------------------------------------------------------------- failures


class _Flaky:
    """A logger whose log() raises from its second call on."""

    name = "tensorboard"
    module = "json"  # (imports)
    instances: list["_Flaky"] = []

    @staticmethod
    def check():
        return None

    def __init__(self, run_dir, config, saved):
        self.calls, self.closed = 0, None
        _Flaky.instances.append(self)

    def saved(self):
        return {}

    def log(self, step, metrics):
        self.calls += 1
        if self.calls >= 2:
            raise ConnectionError("tracking server went away")

    def summary(self, summary):
        raise AssertionError("a dropped logger gets nothing more")

    def close(self, status):
        self.closed = status


FAILED_MID_RUN = ("the tensorboard logger failed (log): ConnectionError: tracking server went away; training goes on "
                  "without it (metrics.csv keeps every row)")


def test_a_logger_that_fails_mid_run_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(_loggers.LOGGERS, "tensorboard", _Flaky)
    _Flaky.instances.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _train(tmp_path, "train.loggers=[csv,tensorboard]")
    said = [str(w.message) for w in caught if issubclass(w.category, _loggers.LoggerWarning)]
    assert said == [FAILED_MID_RUN]
    (flaky,) = _Flaky.instances
    assert flaky.calls == 2 and flaky.closed == "failed"  # closed once dropped, never called again
    assert _summary(run)["status"] == "completed" and sorted(_csv(run)) == [2, 3, 4, 6]


def test_a_logger_that_fails_mid_run_is_one_kiln_warning_line(tmp_path, monkeypatch, capsys):
    import sys

    import kiln.errors

    monkeypatch.setitem(_loggers.LOGGERS, "tensorboard", _Flaky)
    monkeypatch.setattr(kiln.errors, "_shown", set())  # (what this process showed before)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own default
        # shown as Python shows a warning outside pytest, which records them instead
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        _train(tmp_path, "train.loggers=[csv,tensorboard]")
    err = capsys.readouterr().err.splitlines()
    # not "kiln/train/_loggers.py:301: LoggerWarning: ..." and then the line of source
    assert [line for line in err if "warn" in line.lower() or "logger" in line] == [f"kiln: warning: {FAILED_MID_RUN}"]


def test_a_logger_that_cannot_start_stops_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """What the check before the run cannot foresee (a key the server refuses) stops the run
    when the logger starts: exit status 2, one line, and the run directory marked failed."""
    class Refusing(_Flaky):
        def __init__(self, *args):
            raise PermissionError("api key refused")

    monkeypatch.setitem(_loggers.LOGGERS, "tensorboard", Refusing)
    capsys.readouterr()
    assert main(["train", MLP, f"train.output_dir={tmp_path}", *SHORT, "train.loggers=[csv,tensorboard]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kiln: error: train.loggers includes tensorboard, but it could not start (PermissionError: api key "
                   "refused); fix that, or remove tensorboard from train.loggers")
    (run,) = tmp_path.iterdir()
    assert _summary(run)["status"] == "failed" and not (run / "metrics.csv").read_text().count("\n") > 1


def _refused(capsys, tmp_path: Path, name: str) -> str:
    """``kiln train`` with logger ``name``: exit status 2, one line, and nothing built."""
    capsys.readouterr()
    assert main(["train", MLP, f"train.output_dir={tmp_path / 'runs'}", *SHORT, f"train.loggers=[csv,{name}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"kiln: error: train.loggers includes {name}, but "), err
    assert not (tmp_path / "runs").exists()
    return err


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    """An environment where W&B finds no API key and no setting (not the machine's own)."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("machine example.com login me password secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def test_wandb_without_an_api_key_is_refused_before_anything_is_built(tmp_path, capsys, no_wandb_key):
    pytest.importorskip("wandb")
    err = _refused(capsys, tmp_path, "wandb")
    assert "no W&B API key is configured here: run `wandb login` (or set WANDB_API_KEY), or log offline with " \
           "WANDB_MODE=offline; or remove wandb from train.loggers" in err


def test_wandb_finds_a_key_where_wandb_does(tmp_path, monkeypatch, no_wandb_key):
    pytest.importorskip("wandb")
    assert _loggers.WandbLogger.check().startswith("no W&B API key is configured here")
    for var, value in (("WANDB_MODE", "offline"), ("WANDB_MODE", "disabled"), ("WANDB_API_KEY", "x" * 40)):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert _loggers.WandbLogger.check() is None, var
    (tmp_path / "wandb-config").mkdir()
    (tmp_path / "wandb-config" / "settings").write_text("[default]\nmode = offline\n")  # `wandb offline`
    assert _loggers.WandbLogger.check() is None
    (tmp_path / "wandb-config" / "settings").write_text("[default]\nbase_url = https://wandb.example.org\n")
    assert _loggers.WandbLogger.check().startswith("no W&B API key")  # the netrc names no entry for that host yet
    (tmp_path / "netrc").write_text("machine wandb.example.org login user password KEY\n")  # `wandb login`
    assert _loggers.WandbLogger.check() is None


def test_mlflow_whose_tracking_server_does_not_answer_is_refused_before_anything_is_built(tmp_path, capsys,
                                                                                         monkeypatch):
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    err = _refused(capsys, tmp_path, "mlflow")
    assert f"its tracking server http://127.0.0.1:{port} does not answer (" in err
    assert "start it, or set MLFLOW_TRACKING_URI to one that runs, or to a local folder (file:./mlruns)" in err


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                          ("tensorboard", "torch.utils.tensorboard")])
def test_a_logger_whose_package_is_absent_or_broken_is_refused_before_anything_is_built(tmp_path, capsys,
                                                                                         monkeypatch, name, module):
    import importlib.abc
    import importlib.util
    import sys

    with monkeypatch.context() as m:  # absent: the import finds nothing
        m.setitem(sys.modules, name, None)
        assert f"the {name} package is not installed; pip install 'kiln[{name}]'" in _refused(capsys, tmp_path, name)

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Installed, but its import fails (a dependency of the wrong version, say)."""

        def find_spec(self, fullname, path, target=None):
            return importlib.util.spec_from_loader(fullname, self) if fullname == module else None

        def create_module(self, spec):
            return None

        def exec_module(self, mod):
            raise ImportError("cannot import name 'x' from 'protobuf'")

    for loaded in [k for k in sys.modules if k == module or k.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    err = _refused(capsys, tmp_path, name)
    assert (f"but {module} does not import (ImportError: cannot import name 'x' from 'protobuf'); reinstall it with "
            f"pip install 'kiln[{name}]'; or remove {name} from train.loggers") in err


def test_an_unknown_logger_is_refused_at_config_load_naming_the_valid_ones(tmp_path, capsys):
    assert main(["train", MLP, f"train.output_dir={tmp_path}", "train.loggers=[csv,neptune]"]) == 2
    assert "train.loggers[1]='neptune' is not allowed (expected one of 'csv', 'tensorboard', 'wandb', 'mlflow')" \
        in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_a_logger_whose_package_is_missing_is_refused_at_config_load(tmp_path, capsys, monkeypatch, name):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else find_spec(n, *a))
    assert main(["train", MLP, f"train.output_dir={tmp_path}", f"train.loggers=[csv,{name}]"]) == 2
    assert (f"train.loggers includes {name}, but the {name} package is not installed; pip install 'kiln[{name}]'"
            in capsys.readouterr().err)


def test_the_trainer_imports_no_logger_package_until_one_is_named(fresh_python):
    code = ("import sys, kiln.train, kiln.train.loop; "
            "print([m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules])")
    out = fresh_python(code)
    assert out.strip() == "[]"


@pytest.mark.distributed
def test_rank_0_logs_alone(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    done = kiln_here("train", MLP, "--nproc", "2", f"train.output_dir={tmp_path}", *SHORT,
                     "train.loggers=[csv,tensorboard,wandb]")
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = tmp_path.iterdir()
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (only,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert sorted(_wandb_run(only)["history"]) == [2, 3, 4, 6]
