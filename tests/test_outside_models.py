"""Models, data and losses from outside kiln through ``kiln train``: a user's own module with
mapping batches and its own loss and metric, and Hugging Face transformers models (GPT-2,
Llama, BERT) built from their config classes. Each trains exactly as a plain PyTorch loop with
``torch.optim.AdamW`` on the same data order, under every acceleration, and resumes bitwise."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from kiln.commands import main
from kiln.train import load_checkpoint, read_metrics

ROOT = Path(__file__).resolve().parents[1]
HF_CONFIGS = {"gpt2": "hf_gpt2_tiny", "llama": "hf_llama_tiny", "bert": "hf_bert_tiny"}

# A user's own code, all in the config file: a model that takes a mapping batch (model(**batch))
# and returns a mapping, a data function returning two map-style datasets of dict samples, a loss
# and a metric. None of it knows kiln.
USER_CONFIG = '''
import torch
from torch import nn
from torch.utils.data import Dataset

from kiln.config import LazyCall as L


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.sin(self.x[:, :3].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}


def make_points(n=256, val=64):
    return Points(n, 1), Points(val, 2)


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh())
                                    for _ in range(3))
        self.out = nn.Linear(width, 1)

    def forward(self, features, target=None):
        h = self.stem(features)
        for layer in self.layers:
            h = h + layer(h)
        return {"prediction": self.out(h)}


def scaled_mse(outputs, batch, scale=1.0):
    return scale * ((outputs["prediction"] - batch["target"]) ** 2).mean()


def mae(outputs, batch):
    return (outputs["prediction"] - batch["target"]).abs().mean()


model = L(Net)(width=16)
data = L(make_points)(n=256, val=64, batch_size=32, eval_batch_size=64)
optim = dict(name="adamw", lr=1e-2, weight_decay=0.01, no_decay_1d=False, schedule="constant")
train = dict(max_steps=12, log_every=1, eval_every=0, loss=L(scaled_mse)(scale=2.0), metrics=dict(mae=L(mae)()))
'''


def _user_config(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(USER_CONFIG))
    return path


def _only_run(folder: Path) -> Path:
    (run,) = [p for p in folder.iterdir() if p.is_dir()]
    return run


def _train(config: Path | str, out: Path, *overrides: str) -> Path:
    """``kiln train`` in fp32, the plain loops' precision, unless ``overrides`` name another
    (the later override wins): train.precision=auto is bf16-mixed where bf16 is native."""
    assert main(["train", str(config), "train.precision=fp32", f"train.output_dir={out}", *overrides]) == 0
    return _only_run(out)


def _plain_adamw(model, train_set, *, batch: int, steps: int, lr: float, seed: int, loss_of) -> list[float]:
    """The plain PyTorch loop: torch.optim.AdamW, DistributedSampler's one-process order."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        sampler.set_epoch(epoch)
        for b in DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True):
            loss = loss_of(model, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses


def _logged_losses(run: Path) -> list[float]:
    return [float(r["train_loss"]) for r in read_metrics(run)]


def _max_rel(got: list[float], ref: list[float]) -> float:
    """Largest difference relative to the reference (metrics.csv keeps 6 significant digits)."""
    assert len(got) == len(ref)
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def test_a_user_module_with_mapping_batches_and_its_own_loss_and_metric_trains_like_a_plain_loop(tmp_path, capsys):
    config = _user_config(tmp_path)
    run = _train(config, tmp_path / "runs")
    # the same model, data and loss from the config file, trained by hand
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_model_by_hand", config)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    torch.manual_seed(0)
    train_set, val_set = user.make_points(n=256, val=64)
    model = user.Net(width=16)
    ref = _plain_adamw(model, train_set, batch=32, steps=12, lr=1e-2, seed=0,
                       loss_of=lambda m, b: user.scaled_mse(m(**b), b, scale=2.0))
    got = _logged_losses(run)
    assert len(got) == 12 and sum(ref[-4:]) < sum(ref[:4])  # 12 steps across an epoch end (8 each); it learns
    assert _max_rel(got, ref) < 1e-5, (got, ref)
    summary = json.loads((run / "summary.json").read_text())
    with torch.no_grad():
        out = model(**{"features": val_set.x, "target": val_set.y})
        val_loss = user.scaled_mse(out, {"target": val_set.y}, scale=2.0).item()
        val_mae = user.mae(out, {"target": val_set.y}).item()
    assert set(summary["eval"]) == {"loss", "mae"}  # the user's metric, and no accuracy without labels
    assert summary["eval"]["loss"] == pytest.approx(val_loss, abs=1e-5)
    assert summary["eval"]["mae"] == pytest.approx(val_mae, abs=1e-5)
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "eval_mae" in header and "eval_accuracy" not in header
    saved = (run / "config.yaml").read_text()
    assert "user_model.py:scaled_mse" in saved  # the run directory names the function it trained with
    capsys.readouterr()
    assert main(["plan", str(config)]) == 0
    assert "user_model.py:make_points(n=256, val=64)" in capsys.readouterr().out
    assert main(["report", str(run), "--out", str(tmp_path / "report.png")]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[4:6] == ["eval_loss", "eval_mae"] and f"{summary['eval']['mae']:.4g}" in row.split()


def _hf_model_and_data(name: str, overrides: list[str]):
    """What the bundled config builds, by hand: the same seed, data and model, in kiln's order."""
    pytest.importorskip("transformers")
    from kiln.config import instantiate, load_config
    from kiln.data import build_dataset

    cfg = load_config(ROOT / "configs" / f"{HF_CONFIGS[name]}.py", overrides)
    torch.manual_seed(0)
    splits = build_dataset(cfg.data.name, seed=0, **dict(cfg.data.args))
    return instantiate(cfg.model), splits


def _hf_loss(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())  # -100: not scored (mlm)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_models_train_like_a_plain_loop_and_are_written_for_from_pretrained(tmp_path, name):
    overrides = ["train.max_steps=8", "train.log_every=1", "train.eval_every=0", "optim.schedule=constant",
                 "optim.weight_decay=0.01", "optim.no_decay_1d=false",
                 "data.args.num_samples=192"]  # 6 steps an epoch: one epoch end
    model, splits = _hf_model_and_data(name, overrides)
    run = _train(ROOT / "configs" / f"{HF_CONFIGS[name]}.py", tmp_path / "runs", *overrides)
    ref = _plain_adamw(model, splits.train, batch=32, steps=8, lr=3e-3, seed=0, loss_of=_hf_loss)
    got = _logged_losses(run)
    assert len(got) == 8 and ref[-1] < ref[0] - 0.3
    assert _max_rel(got, ref) < 1e-5, (got, ref)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval"]) == {"loss", "accuracy", "perplexity"}
    assert summary["eval"]["perplexity"] == pytest.approx(torch.tensor(summary["eval"]["loss"]).exp().item())
    # RUN_DIR/hf/ is the trained model in the Hugging Face layout
    loaded = type(model).from_pretrained(run / "hf")
    model.eval(), loaded.eval()
    ids = splits.val[0][0][None]
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)


def test_import_kiln_never_imports_transformers(fresh_python):  # (once, not in each family's test above)
    assert "transformers" not in fresh_python("import sys, kiln, kiln.train, kiln.hf; print(sorted(sys.modules))")


def _loss_curve(run: Path) -> list[float]:
    return _logged_losses(run)


ACCELERATED = ["user", "gpt2", "llama", "bert"]
# The bundled configs' 32 x 64-token batches cost ~1.3 s of CPU a step on the test machine; 8 x 32
# tokens train the same models through the same code (8 steps an epoch still, as 32 x 256 samples
# did; the two-process runs' micro-batches are 2 samples), at an eighth of the compute.
SMALL_LM_DATA = ["data.batch_size=8", "data.args.seq_len=32", "data.args.val_samples=16"]
TWO_PROCESSES = ((2, 1), (3, 2))  # (ZeRO stage, accumulation): 2 processes x 2 micro-batches, the same samples a step


def _accelerated(name: str, folder: Path) -> tuple[Path, list[str]]:
    """The config and base overrides of test_outside_models_train_under_every_acceleration."""
    folder.mkdir(parents=True, exist_ok=True)
    if name == "user":
        config, base = _user_config(folder), ["train.max_steps=12"]
    else:
        config, base = ROOT / "configs" / f"{HF_CONFIGS[name]}.py", ["train.max_steps=8", "train.log_every=1",
                                                                      *SMALL_LM_DATA, "data.args.num_samples=64"]
    return config, [*base, "train.eval_every=0", "train.clip_grad_norm=1.0"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """(model, ZeRO stage) -> the run directory of each model's two-process runs, all of them in
    one pair of gloo processes started once (tests/group_runs.py): eight launches of kiln train
    --nproc 2 spent most of their time starting processes."""
    from importlib.util import find_spec

    from group_runs import train_in_one_group

    folder = tmp_path_factory.mktemp("two")
    names = [n for n in ACCELERATED if n == "user" or find_spec("transformers")]
    keys, runs = [], []
    for name in names:
        config, base = _accelerated(name, folder / name)
        for zero, accumulate in TWO_PROCESSES:
            keys.append((name, zero))
            runs.append((str(config), ["train.precision=fp32", f"parallel.zero={zero}", f"train.accumulate={accumulate}",
                                       f"train.output_dir={folder / name / f'zero{zero}'}", *base]))
    return dict(zip(keys, train_in_one_group(2, runs)))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ACCELERATED)
def test_outside_models_train_under_every_acceleration(tmp_path, two_process_runs, name):
    """bf16-mixed with activation checkpointing, compile, and two processes with ZeRO-2 and
    FSDP2 (ZeRO-3, with accumulation): each trains, with clipping on; compile and the
    two-process runs equal one process."""
    if name != "user":
        pytest.importorskip("transformers")
    config, base = _accelerated(name, tmp_path / name)
    one = _loss_curve(_train(config, tmp_path / "one", *base))
    mixed = _loss_curve(_train(config, tmp_path / "mixed", *base, "train.precision=bf16-mixed",
                               "train.activation_checkpointing=full"))
    assert mixed[-1] < mixed[0] and _max_rel(mixed, one) < 0.05  # bf16: within 5% of fp32 at every step
    compiled = _loss_curve(_train(config, tmp_path / "compiled", *base, "train.compile=true"))
    assert _max_rel(compiled, one) < 1e-4
    for zero, _ in TWO_PROCESSES:
        two = _loss_curve(two_process_runs[name, zero])
        assert _max_rel(two, one) < 1e-5, (zero, two, one)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["user", "gpt2", "llama", "bert"])
def test_kill_9_then_resume_of_an_outside_model_is_bitwise(tmp_path, kill_9_at, name):
    if name == "user":
        config, args = _user_config(tmp_path), ["train.max_steps=40"]
    else:
        pytest.importorskip("transformers")
        config, args = ROOT / "configs" / f"{HF_CONFIGS[name]}.py", ["train.max_steps=40", *SMALL_LM_DATA,
                                                                      "data.args.num_samples=128"]  # 16 steps an epoch
    args += ["train.checkpoint_every=5", "train.log_every=5", "train.eval_every=20"]
    whole = _train(config, tmp_path / "whole", *args)
    run = kill_9_at([config, *args], tmp_path / "killed", "step-00000015")
    assert main(["train", "--resume", str(run)]) == 0
    a, b = (json.loads((r / "summary.json").read_text()) for r in (whole, run))
    assert b["status"] == "completed" and a["final_train_loss"] == b["final_train_loss"] and a["eval"] == b["eval"]
    wa, wb = (load_checkpoint(r / "checkpoints" / "final") for r in (whole, run))
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])


def test_early_stopping_on_a_users_own_metric(tmp_path):
    config = _user_config(tmp_path)
    # an improvement must beat min_delta=100: the second evaluation stops the run (patience 1)
    run = _train(config, tmp_path / "runs", "train.max_steps=12", "train.eval_every=2",
                 "train.early_stopping.metric=eval_mae", "train.early_stopping.patience=1",
                 "train.early_stopping.min_delta=100")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] and summary["stopped_at_step"] == 4 and "eval_mae" in summary["stop_reason"]


def test_every_kind_of_model_output_gives_its_loss_or_logits():
    from kiln.train._tasks import Task, micro_batch_loss, split_outputs

    logits, loss = torch.randn(4, 3), torch.tensor(0.5)
    assert split_outputs(logits) == (None, logits)
    assert split_outputs({"logits": logits}) == (None, logits)
    assert split_outputs({"loss": loss, "logits": logits}) == (loss, logits)
    assert split_outputs((logits, "cache")) == (None, logits)  # return_dict=False without labels
    assert split_outputs((loss, logits)) == (loss, logits)  # ... and with labels: (loss, logits, ...)
    assert split_outputs(({"logits": logits},)) == (None, logits)
    with pytest.raises(TypeError, match="train.loss"):
        split_outputs("text")
    batch = (torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    model = torch.nn.Linear(2, 3)
    expected = F.cross_entropy(model(batch[0]), batch[1])
    for wrap in (lambda x: x, lambda x: {"logits": x}, lambda x: (x, None)):
        got = micro_batch_loss(Task("classification"), lambda x: wrap(model(x)), batch)
        assert torch.equal(got, expected)
    # a returned loss is used as it is; train.loss wins over both
    assert micro_batch_loss(Task(None), lambda x: {"loss": loss}, batch) is loss
    assert micro_batch_loss(Task(None, loss=lambda out, b: out.sum() * 0 + 7), model, batch).item() == 7
    with pytest.raises(ValueError, match="no loss.*train.loss"):
        micro_batch_loss(Task(None), model, (batch[0],))  # logits but no targets
    with pytest.raises(ValueError, match="scalar"):
        micro_batch_loss(Task(None, loss=lambda out, b: out), model, batch)


def test_hf_style_mapping_batches_score_the_next_token_of_their_labels():
    from kiln.train._tasks import Task, evaluate, micro_batch_loss

    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 11)
    model = lambda input_ids, labels=None, attention_mask=None: {"logits": emb(input_ids)}  # noqa: E731
    ids = torch.randint(0, 11, (3, 5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    expected = F.cross_entropy(emb(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())  # token t predicts t + 1
    assert torch.allclose(micro_batch_loss(Task("lm"), model, batch), expected)
    metrics = evaluate(Task("lm"), _Call(model), [batch], torch.device("cpu"))
    assert metrics["loss"] == pytest.approx(expected.item()) and set(metrics) == {"loss", "accuracy", "perplexity"}


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, **batch):
        return self.fn(**batch)


def test_weights_from_a_local_hf_directory_are_the_starting_point(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    source = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                        bos_token_id=0, eos_token_id=0))
    source.save_pretrained(tmp_path / "pretrained")
    config = tmp_path / "from_pretrained.py"
    config.write_text(textwrap.dedent(f'''
        import kiln.hf
        from kiln.config import LazyCall as L

        model = L(kiln.hf.from_pretrained)(path={str(tmp_path / "pretrained")!r}, model_class="GPT2LMHeadModel")
        data = dict(name="text_lm", batch_size=8, args=dict(seq_len=32, num_samples=64, val_samples=16))
        optim = dict(lr=1e-3)
        train = dict(max_steps=1, log_every=1)
    '''))
    # one step at lr 1e-30: the run's model is the pretrained one to 1e-20 (zero biases move by 1e-30)
    run = _train(config, tmp_path / "runs", "optim.lr=1e-30", "optim.schedule=constant", "optim.weight_decay=0")
    final = load_checkpoint(run / "checkpoints" / "final")["model"]
    for name, p in source.state_dict().items():
        if name in final:
            # (GPT-2's fused c_attn is checkpointed as (C, 3, C), the same elements in the same order)
            assert torch.allclose(final[name].reshape(p.shape), p, rtol=0, atol=1e-20), name  # init differs by ~1e-2
    with pytest.raises(FileNotFoundError, match="not a directory"):
        import kiln.hf

        kiln.hf.from_pretrained(str(tmp_path / "missing"))


HF_DATA_CONFIG = '''
import datasets
from transformers import GPT2Config, GPT2LMHeadModel

from kiln.config import LazyCall as L


def local_json(train, validation):
    """A Hugging Face DatasetDict read from local JSON-lines files (no download)."""
    return datasets.load_dataset("json", data_files={{"train": train, "validation": validation}})


model = L(GPT2LMHeadModel)(config=L(GPT2Config)(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                 bos_token_id=0, eos_token_id=0))
data = L(local_json)(train={train!r}, validation={val!r}, batch_size=8, eval_batch_size=8)
optim = dict(lr=3e-3, schedule="constant")
train = dict(max_steps=10, log_every=1)
'''


def test_a_hugging_face_dataset_from_local_files_with_mapping_batches_and_the_models_own_loss(tmp_path):
    """input_ids/attention_mask/labels rows: the model is called with the whole mapping and
    returns its own loss (labels shifted inside the model), which kiln uses as it is."""
    pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 48), ("val", 12)):
        rows = []
        for _ in range(n):
            start = int(torch.randint(0, 16, (), generator=g))
            ids = [(start + 3 * i) % 32 for i in range(16)]  # learnable: each id predicts the next
            rows.append(json.dumps({"input_ids": ids, "attention_mask": [1] * 16, "labels": ids}))
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    config = tmp_path / "hf_data.py"
    config.write_text(textwrap.dedent(HF_DATA_CONFIG.format(train=str(tmp_path / "train.jsonl"),
                                                            val=str(tmp_path / "val.jsonl"))))
    run = _train(config, tmp_path / "runs")
    losses = _logged_losses(run)
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval"]) == {"loss", "accuracy", "perplexity"}  # lm: the labels are one per token
    # the eval loss is the model's own loss over the whole validation set
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(run / "hf").eval()
    rows = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    ids = torch.tensor([r["input_ids"] for r in rows])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert summary["eval"]["loss"] == pytest.approx(out.loss.item(), abs=1e-5)
    predicted = out.logits[:, :-1].argmax(-1) == ids[:, 1:]  # token t predicts token t + 1
    assert summary["eval"]["accuracy"] == pytest.approx(predicted.float().mean().item(), abs=1e-6)


STREAM_CONFIG = '''
import torch
from torch import nn
from torch.utils.data import IterableDataset

from kiln.config import LazyCall as L


class Sequences(IterableDataset):
    """Variable-length sequences of token ids, each labelled by whether its sum is even."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(self.n):
            ids = torch.randint(1, 20, (int(torch.randint(2, 9, (), generator=g)),), generator=g).tolist()
            yield ids, sum(ids) % 2


def streams(n=96, seed=0):
    return Sequences(n, 100 + seed), Sequences(32, 7)


def pad(samples, to=8):
    ids = torch.zeros(len(samples), to, dtype=torch.long)
    for i, (seq, _) in enumerate(samples):
        ids[i, :len(seq)] = torch.tensor(seq)
    return ids, torch.tensor([label for _, label in samples])


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, padding_idx=0)
        self.out = nn.Linear(8, 2)

    def forward(self, ids):
        return self.out(self.emb(ids))


model = L(Bag)()
data = L(streams)(n=96, batch_size=16, collate_fn=L(pad)(to=8))
train = dict(max_steps=9, log_every=1)
'''


def test_an_iterable_dataset_with_its_own_collate_fn(tmp_path):
    config = tmp_path / "stream.py"
    config.write_text(textwrap.dedent(STREAM_CONFIG))
    run = _train(config, tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 9 and set(summary["eval"]) == {"loss", "accuracy"}  # one label a sample
    # 96 samples a pass = 6 steps of 16: step 9 is in the second pass over the stream
    assert [int(float(r["epoch"])) for r in read_metrics(run)][-1] == 1


@pytest.mark.e2e
def test_bench_hf_quick_measures_kiln_and_the_trainer_on_one_model(tmp_path):
    pytest.importorskip("accelerate")
    from kiln.bench import run_benchmark

    result = run_benchmark("hf", tmp_path, quick=True)
    rates = result["samples_per_s"]
    assert set(rates) == {"trainer", "kiln fp32", "kiln bf16-mixed"} and all(r > 0 for r in rates.values())
    assert result["vs_trainer"]["kiln fp32"] == pytest.approx(rates["kiln fp32"] / rates["trainer"])
    assert result["kiln_best"] in rates and result["cpu_capability"]
    assert json.loads((tmp_path / "hf.json").read_text())["samples_per_s"] == rates
    assert (tmp_path / "hf.png").stat().st_size > 5_000


@pytest.mark.parametrize("command", ["plan", "train"])
def test_tensor_or_pipeline_parallel_for_a_family_without_a_plan_is_refused_in_one_line(tmp_path, capsys, command):
    # a user's own module (GPT-2, Llama and BERT from transformers have plans since issue 14)
    (tmp_path / "cfg").mkdir()
    config = str(_user_config(tmp_path / "cfg"))
    out = tmp_path / "out"
    for key in ("parallel.tp=2", "parallel.pp=2"):
        code = main([command, config, "--nproc", "2", key, f"train.output_dir={out}"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert key in err and "hf gpt2: GPT2LMHeadModel" in err and "has none" in err and key.replace("2", "1") in err
    assert not out.exists() or not any(out.iterdir())  # nothing started, no run directory
