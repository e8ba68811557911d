"""The loggers ``train.loggers`` names besides ``csv`` (``RUN_DIR/metrics.csv``, always written):
``tensorboard``, ``wandb`` (Weights & Biases) and ``mlflow``.

Rank 0 alone logs. Each logger's package is imported only when the logger is named. A named
logger that cannot start stops the run before anything is built, with one line naming the fix
(``ConfigError``, exit status 2): kiln.config refuses one whose package is not installed, and
:func:`check_loggers` one whose package does not import, W&B without an API key (unless it logs
offline), MLflow whose tracking server does not answer. One that fails to start all the same
stops the run there. :class:`Loggers` calls each, in this order: at the start, the config; after
each row of metrics.csv, that row's numbers (:meth:`Loggers.log`); at the end, summary.json
(:meth:`Loggers.summary`), then :meth:`Loggers.close` with how the run ended.

A logger that raises once the run is under way (a tracking server gone, a full disk) is dropped
with one warning and the run goes on: metrics.csv still holds every row. What a resumed run
needs to continue the same logged run (W&B's run id, MLflow's run id and tracking URI) is kept
in ``RUN_DIR/loggers.json``.

Where they write: TensorBoard to ``RUN_DIR/tensorboard/``; W&B to ``RUN_DIR/wandb/`` and its
project (``WANDB_PROJECT``, else ``kiln``; ``WANDB_MODE=offline`` keeps it on disk); MLflow to
``MLFLOW_TRACKING_URI`` (else MLflow's default), experiment ``MLFLOW_EXPERIMENT_NAME`` (else
``kiln``). Each logged run is named after the run directory.
"""

from __future__ import annotations

import configparser
import importlib
import json
import netrc
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, KilnWarning
from kiln.train.run_dir import CONFIG

__all__ = ["LOGGERS_FILE", "LoggerWarning", "Loggers", "check_loggers"]

LOGGERS_FILE = "loggers.json"


class LoggerWarning(KilnWarning):
    """A logger failed; the run goes on without it."""


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's metrics as numbers: what a logger's charts take (no step, no empty cells)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardLogger:
    """Scalars to ``RUN_DIR/tensorboard`` (``eval_loss`` as ``eval/loss``); the config and the
    summary as text. A resumed run appends to the same directory."""

    name = "tensorboard"
    module = "torch.utils.tensorboard"  # (imports the tensorboard package)

    @staticmethod
    def check() -> str | None:
        return None  # it writes files: importing it is all it needs

    def __init__(self, run_dir: Path, config: dict[str, Any], saved: dict[str, Any] | None):
        from torch.utils.tensorboard import SummaryWriter  # imported only when asked for

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if saved is None:
            self.writer.add_text("config", _as_code(config))

    def saved(self) -> dict[str, Any]:
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key.replace("eval_", "eval/").replace("train_", "train/"), value, step)
        self.writer.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", _as_code(summary), summary.get("steps"))
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


def _as_code(tree: dict[str, Any]) -> str:
    """JSON as a Markdown code block (TensorBoard renders its text as Markdown)."""
    return "\n".join("    " + line for line in json.dumps(tree, indent=2, default=str).splitlines())


class WandbLogger:
    """A Weights & Biases run: the config, each row at its step, the summary; resumed by id."""

    name = "wandb"
    module = "wandb"

    @staticmethod
    def check() -> str | None:
        """No API key where W&B looks for one (WANDB_API_KEY, ``wandb login``'s netrc entry), and
        not logging offline: ``wandb.init`` would fail, or wait at a prompt."""
        settings = _wandb_settings()
        mode = os.environ.get("WANDB_MODE") or settings.get("mode", "")
        if mode in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY") \
                or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_has(_wandb_host(settings)):
            return None
        return ("no W&B API key is configured here: run `wandb login` (or set WANDB_API_KEY), or log offline "
                "with WANDB_MODE=offline")

    def __init__(self, run_dir: Path, config: dict[str, Any], saved: dict[str, Any] | None):
        import wandb  # imported only when asked for

        if saved is None:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "kiln"), name=run_dir.name,
                                  dir=str(run_dir), config=config)
        else:  # the same logged run: W&B appends what comes after the checkpoint
            self.run = wandb.init(project=saved["project"], id=saved["id"], resume="allow", dir=str(run_dir))
            self.run.config.update(config, allow_val_change=True)  # a resume may extend train.max_steps

    def saved(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


def _wandb_settings() -> dict[str, str]:
    """W&B's settings files' ``[default]`` keys (``wandb offline`` and ``wandb login --host``
    write them): the user's, then the working directory's, which wins."""
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb")
    parser = configparser.ConfigParser()
    try:
        parser.read([os.path.join(config_dir, "settings"), os.path.join(os.environ.get("WANDB_DIR", "."),
                                                                         "wandb", "settings")])
    except configparser.Error:
        return {}
    return dict(parser["default"]) if parser.has_section("default") else {}


def _wandb_host(settings: dict[str, str]) -> str:
    """The host of the W&B server this wandb logs to: WANDB_BASE_URL, the settings', or its default."""
    url = os.environ.get("WANDB_BASE_URL") or settings.get("base_url")
    if not url:
        try:  # (wandb 0.2x: api.wandb.ai; later ones name their own)
            url = importlib.import_module("wandb.sdk.lib.urls").DEFAULT_BASE_URL
        except (ImportError, AttributeError):
            url = "https://api.wandb.ai"
    return urllib.parse.urlparse(url).hostname or url


def _netrc_has(host: str) -> bool:
    """Whether the netrc file (NETRC, else ~/.netrc: where ``wandb login`` keeps the key) has ``host``."""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MlflowLogger:
    """An MLflow run: the config as parameters (dotted keys) and config.yaml as an artifact,
    each row's metrics at its step, summary.json as an artifact; resumed by run id."""

    name = "mlflow"
    module = "mlflow"
    # how kiln's run statuses end an MLflow run
    STATUS = {"completed": "FINISHED", "interrupted": "KILLED"}

    @staticmethod
    def check(timeout_s: float = 5.0) -> str | None:
        """A tracking server (http, https) that does not answer within ``timeout_s``. A local store
        (a path, file:, sqlite:) needs nothing; another remote store (databricks, a database)
        is left to MLflow."""
        import mlflow

        uri = mlflow.get_tracking_uri()
        if urllib.parse.urlparse(uri).scheme not in ("http", "https"):
            return None
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            return None  # it answered (a login page, another version's routes)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return (f"its tracking server {uri} does not answer ({reason}): start it, or set MLFLOW_TRACKING_URI to "
                    "one that runs, or to a local folder (file:./mlruns)")
        return None

    def __init__(self, run_dir: Path, config: dict[str, Any], saved: dict[str, Any] | None):
        import mlflow  # imported only when asked for
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if saved is not None:  # the same store and run, whatever the environment says now
            self.client = MlflowClient(tracking_uri=saved["tracking_uri"])
            self.run_id, self.tracking_uri = saved["run_id"], saved["tracking_uri"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.tracking_uri = mlflow.get_tracking_uri()
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "kiln")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"kiln.run_dir": str(run_dir)})
            self.run_id = run.info.run_id
            # parameters cannot change once logged: a resume keeps the first ones (config.yaml,
            # logged again below, is the config that runs now)
            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]  # MLflow's longest value
            for i in range(0, len(params), 100):  # at most 100 to a batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_artifact(self.run_id, str(run_dir / CONFIG))

    def saved(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def summary(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS.get(status, "FAILED"))


LOGGERS = {cls.name: cls for cls in (TensorBoardLogger, WandbLogger, MlflowLogger)}


def check_loggers(names: list[str]) -> None:
    """Refuse, before anything is built, a logger in ``names`` that cannot start here: its
    package does not import, or its own check finds a problem (``check()``): ConfigError,
    naming the fix."""
    for name in dict.fromkeys(names):
        if name == "csv":
            continue
        logger = LOGGERS[name]
        try:
            importlib.import_module(logger.module)
        except Exception as exc:  # noqa: BLE001  (a broken install raises anything as it imports)
            problem = (f"{logger.module} does not import ({_one_line(exc)}); reinstall it with "
                       f"pip install 'kiln[{name}]'")
        else:
            problem = logger.check()
        if problem:
            raise ConfigError(f"train.loggers includes {name}, but {problem}; or remove {name} from train.loggers")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"


class Loggers:
    """The run's loggers (rank 0's; the other ranks hold none), each called through one guard
    once started: a logger that raises is warned about once and dropped, and the run goes on."""

    def __init__(self, loggers: list[Any] | None = None):
        self.active = list(loggers or [])

    @classmethod
    def open(cls, names: list[str], run_dir: Path, config: dict[str, Any], *, resumed: bool) -> "Loggers":
        """Start the loggers ``names`` (``csv`` is metrics.csv: not one of them) for the run in
        ``run_dir``; ``resumed``: continue the logged runs that ``loggers.json`` names."""
        path = run_dir / LOGGERS_FILE
        saved = json.loads(path.read_text()) if resumed and path.is_file() else {}
        loggers = cls()
        for name in names:
            if name == "csv":
                continue
            try:
                logger = LOGGERS[name](run_dir, config, saved.get(name))
            except Exception as exc:  # noqa: BLE001  (what check_loggers could not foresee: a key refused)
                loggers.close("failed")
                raise ConfigError(f"train.loggers includes {name}, but it could not start ({_one_line(exc)}); "
                                  f"fix that, or remove {name} from train.loggers") from exc
            loggers.active.append(logger)
            saved[name] = logger.saved()
        if loggers.active:
            path.write_text(json.dumps(saved, indent=2) + "\n")
        return loggers

    def log(self, step: int, row: dict[str, Any]) -> None:
        """A row of metrics.csv, at ``step``."""
        if self.active:  # (most runs log to metrics.csv alone: nothing to convert)
            self._each("log", step, _numbers(row))

    def summary(self, summary: dict[str, Any]) -> None:
        self._each("summary", summary)

    def close(self, status: str) -> None:
        """End every logged run: ``status`` is summary.json's (completed, failed, interrupted)."""
        self._each("close", status)
        self.active = []

    def _each(self, method: str, *args: Any) -> None:
        for logger in list(self.active):
            try:
                getattr(logger, method)(*args)
            except Exception as exc:  # noqa: BLE001  (a logger never stops a run)
                self.active.remove(logger)
                warnings.warn(f"the {logger.name} logger failed ({method}): {_one_line(exc)}; training goes on "
                              "without it (metrics.csv keeps every row)", LoggerWarning, stacklevel=3)
                if method != "close":
                    try:
                        logger.close("failed")
                    except Exception:  # noqa: BLE001  (already said)
                        pass
