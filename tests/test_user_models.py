"""Models as their users write them (issue 24): nine families with padded batches (Qwen2, Mistral,
GPT-NeoX, OPT, Phi, GPT-2 for sequence classification, T5, DistilBERT MLM, a user's module
returning ``{"loss"}``), and a model with nanoGPT's forward contract. Each trains as its own plain
PyTorch loop does, under activation checkpointing, accumulation, ZeRO 0-3 and tensor parallelism;
its metrics are its task's; padded micro-batches and ranks make one big batch; the clip's norm
holds on a long arena. Every run pins train.precision."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.commands import main
from kiln.train import read_metrics

transformers = pytest.importorskip("transformers")

import user_families  # noqa: E402  (tests/user_families.py: the config and its pieces)

CONFIG = Path(user_families.__file__)
FAMILIES = ["qwen2", "mistral", "neox", "opt", "phi", "gpt2cls", "t5", "distilbert", "user"]
PLANNED = ["qwen2", "mistral"]  # families with a tensor-parallel plan (llama-like)
BASE = ["train.precision=fp32", "train.progress=none"]


def _args(family: str, *extra: str) -> list[str]:
    return [f"model.family={family}", f"data.family={family}", *BASE, *extra]


def _train(tmp_path: Path, family: str, *extra: str) -> Path:
    out = tmp_path / "runs"
    before = set(out.iterdir()) if out.exists() else set()
    assert main(["train", str(CONFIG), f"train.output_dir={out}", *_args(family, *extra)]) == 0
    (run,) = set(out.iterdir()) - before
    return run


def _losses(run: Path) -> list[float]:
    return [float(r["train_loss"]) for r in read_metrics(run)]


def _max_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref), (got, ref)
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))


def _plain_loop(family: str, steps: int, batch: int = 16, lr: float = 1e-2, dtype=torch.float32) -> list[float]:
    """The plain PyTorch loop a user writes: torch.optim.AdamW, the model's own loss on each
    whole batch, kiln's sample order (randperm seeded with seed + epoch, whole batches)."""
    torch.manual_seed(0)
    train_set, _ = user_families.padded(family)
    model = user_families.make_model(family).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses, epoch = [], 0
    while len(losses) < steps:
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(epoch))
        for i in range(len(train_set) // batch):
            rows = [train_set[int(j)] for j in order[i * batch:(i + 1) * batch]]
            b = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
            loss = model(**b)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses


# ---- 1. activation checkpointing turns a model's key/value cache off --------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_blocks_of_a_cached_model_give_the_same_gradients(family):
    from kiln.memory import apply_ac, remove_ac

    torch.manual_seed(0)
    model = user_families.make_model(family).train()
    train_set, _ = user_families.padded(family)
    batch = {k: torch.stack([train_set[i][k] for i in range(8)]) for k in train_set[0]}
    model(**batch)["loss"].backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert apply_ac(model, "full") == [0, 1]
    model(**batch)["loss"].backward()  # with the cache on, GPT-2's and Qwen2's fail, T5's saves other tensors
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    config = getattr(model, "config", None)
    if hasattr(config, "use_cache"):
        assert config.use_cache  # the user's config is left as it was (hf/config.json too)
        if family in PLANNED:  # evaluation and generation keep their cache
            model.eval()
            with torch.no_grad():
                assert model(input_ids=batch["input_ids"][:2]).past_key_values is not None
    remove_ac(model)
    assert not any(m._forward_pre_hooks for m in model.modules())


# ---- 2. every family trains as its plain loop, under AC and accumulation ------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_as_its_users_write_it_trains_like_its_plain_loop(tmp_path, family):
    """8 steps of 16 padded samples, 6 steps an epoch: one epoch end."""
    ref = _plain_loop(family, steps=8)
    run = _train(tmp_path, family)
    one = _losses(run)
    assert _max_rel(one, ref) < 1e-4, (one, ref)
    if family != "user":  # RUN_DIR/hf/: the trained model, as from_pretrained loads it, cache setting kept
        from kiln.train import load_checkpoint

        model = user_families.make_model(family)
        loaded = type(model).from_pretrained(run / "hf")
        weights = load_checkpoint(run / "checkpoints" / "final")["model"]
        shared = [k for k in loaded.state_dict() if k in weights]
        assert len(shared) >= len(weights) - 1  # (a tied head is saved once)
        assert all(torch.equal(loaded.state_dict()[k], weights[k].reshape(loaded.state_dict()[k].shape))
                   for k in shared)
        assert getattr(loaded.config, "use_cache", True) is getattr(model.config, "use_cache", True)
    assert _max_rel(_losses(_train(tmp_path, family, "train.activation_checkpointing=full")), one) < 1e-4
    # two padded micro-batches of 8 are one batch of 16: weighted by the positions each scores
    assert _max_rel(_losses(_train(tmp_path, family, "train.accumulate=2")), one) < 1e-4


def test_metrics_follow_the_models_task(tmp_path):
    """T5 (seq2seq) and DistilBERT (masked LM) score each position against its own label, not
    the next one; GPT-2 for sequence classification has accuracy and no perplexity."""
    from kiln.train._tasks import IGNORE, Task, evaluate, model_kind

    for family, kind in (("t5", "seq2seq"), ("distilbert", "mlm"), ("gpt2cls", "classification"), ("qwen2", "lm"),
                         ("user", None)):
        torch.manual_seed(0)
        model = user_families.make_model(family)
        assert model_kind(model) == kind
        if kind not in ("seq2seq", "mlm"):
            continue
        _, val = user_families.padded(family)
        batch = {k: torch.stack([val[i][k] for i in range(len(val))]) for k in val[0]}
        metrics = evaluate(Task(kind), model, [batch], torch.device("cpu"))
        model.eval()
        with torch.no_grad():
            out = model(**batch)
        scored = batch["labels"] != IGNORE
        expected = ((out.logits.argmax(-1) == batch["labels"]) & scored).sum() / scored.sum()
        assert metrics["accuracy"] == pytest.approx(expected.item(), abs=1e-9)
        assert metrics["loss"] == pytest.approx(out.loss.item(), rel=1e-6)
        assert metrics["perplexity"] == pytest.approx(math.exp(out.loss.item()), rel=1e-6)
    for family, names in (("t5", {"loss", "accuracy", "perplexity"}), ("gpt2cls", {"loss", "accuracy"})):
        run = _train(tmp_path, family, "train.max_steps=2")
        assert set(json.loads((run / "summary.json").read_text())["eval"]) == names


def test_data_task_names_the_task_where_the_model_does_not(tmp_path):
    """The user's module is no transformers head: its per-token labels read as a causal LM by
    default; data.task=mlm scores each position against its own label instead."""
    from kiln.config import load_config
    from kiln.train._build import build_data, build_task

    for task, kind in ((None, "lm"), ("mlm", "mlm")):
        cfg = load_config(CONFIG, _args("user", *([f"data.task={task}"] if task else [])))
        data = build_data(cfg.data, seed=0, accumulate=1, device=torch.device("cpu"))
        assert build_task(cfg, data, user_families.make_model("user")).kind == kind
    cfg = load_config(CONFIG, _args("t5", "data.task=lm"))  # the user's word wins over the model's class
    data = build_data(cfg.data, seed=0, accumulate=1, device=torch.device("cpu"))
    assert build_task(cfg, data, user_families.make_model("t5")).kind == "lm"


def test_a_causal_lm_batch_without_labels_trains_on_its_inputs_with_lm_metrics(tmp_path):
    """No labels: a causal LM returns no loss; kiln scores the logits against the input ids
    (padding not scored), exactly as the labelled batch, and reports accuracy and perplexity."""
    labelled = _train(tmp_path, "qwen2", "train.max_steps=3")
    unlabelled = _train(tmp_path, "qwen2", "train.max_steps=3", "data.labels=false")
    assert _losses(unlabelled) == _losses(labelled)
    a, b = (json.loads((r / "summary.json").read_text())["eval"] for r in (labelled, unlabelled))
    assert set(b) == {"loss", "accuracy", "perplexity"} and b == pytest.approx(a, rel=1e-6)


# ---- 3. padded micro-batches and ranks are one big batch ---------------------------------------

def test_padded_micro_batches_weighted_by_scored_tokens_sum_to_the_big_batchs_mean():
    from kiln.train._tasks import Task, loss_parts

    torch.manual_seed(0)
    logits = torch.randn(6, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (6, 5))
    labels[0, 2:] = labels[3, 1:] = -100  # padding: the halves score 12 - 3 - 4 ... positions
    whole = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    micro = [{"input_ids": labels[:3], "labels": labels[:3]}, {"input_ids": labels[3:], "labels": labels[3:]}]
    parts = loss_parts(Task("lm"), micro, 6, 1, lambda x: x, torch.device("cpu"))
    means = [F.cross_entropy(logits[s, :-1].flatten(0, 1), labels[s, 1:].flatten()) for s in (slice(0, 3), slice(3, 6))]
    assert torch.allclose(sum(m / p for m, p in zip(means, parts)), whole, rtol=1e-15)
    assert not torch.allclose(sum(means) / 2, whole, rtol=1e-3)  # the plain halves' mean is another number
    # per-sample losses (classification, train.loss, float targets) keep the samples' shares
    cls = [(torch.randn(3, 4), torch.tensor([0, 1, 2])), (torch.randn(1, 4), torch.tensor([3]))]
    assert loss_parts(Task("classification"), cls, 4, 1, None, torch.device("cpu")) == [4 / 3, 4.0]


def _assert_same_fp64_training(a: Path, b: Path, tol: float = 1e-12) -> None:
    from kiln.train import load_checkpoint

    (sa, sb) = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert sb["final_train_loss"] == pytest.approx(sa["final_train_loss"], rel=tol, abs=0)
    wa, wb = (load_checkpoint(r / "checkpoints" / "final")["model"] for r in (a, b))
    assert next(iter(wa.values())).dtype == torch.float64
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=tol, atol=tol)


# the user's module computes its loss in fp64; an unlabelled Qwen2 batch gets kiln's (transformers'
# own loss upcasts to fp32, which no fp64 check can see past)
FP64 = {"user": ["train.precision=fp64", "train.max_steps=8"],
        "qwen2": ["train.precision=fp64", "train.max_steps=8", "data.labels=false"]}


@pytest.mark.e2e
@pytest.mark.parametrize("family", list(FP64))
def test_padded_accumulation_is_one_big_batch_in_fp64_across_an_epoch_end(tmp_path, family):
    one = _train(tmp_path, family, *FP64[family])
    for k in (2, 4):
        _assert_same_fp64_training(one, _train(tmp_path, family, *FP64[family], f"train.accumulate={k}"))


def _in_two_processes(rank: int, world: int, out: str, cases: list[tuple[str, list[str]]]) -> dict:
    """kiln's trainer, called in a process group the caller made: one run per case, in turn."""
    from kiln.config import load_config
    from kiln.train.loop import train

    results = {}
    for i, (family, extra) in enumerate(cases):
        cfg = load_config(CONFIG, _args(family, *extra))
        result = train(cfg, run_dir=Path(out) / f"case{i}" if rank == 0 else None)
        if rank == 0:
            results[i] = (_losses(result.run_dir), result.summary["eval"], result.summary["status"])
    return results


@pytest.mark.distributed
def test_every_family_in_two_processes_under_zero_0_to_3_and_tp_equals_one_process(tmp_path):
    """Two gloo processes (two ranks of 8 padded samples each, one step of 16), each family under
    ZeRO 0 and 3, whose work depends on the model (the all-reduce of its padded batches' token
    counts, FSDP2's wrapping of its blocks), and under ZeRO-1 or ZeRO-2 in turn (sharding the
    arena's optimizer state or gradients, which never looks at the model: each stage meets four
    or five families); the planned ones under tp=2 too, whose last step evaluates a labelled HF
    LM on vocabulary-sharded logits. Every curve and evaluation equals the one-process run's. In
    fp64, under ZeRO 0 and 2, weights and loss agree to 1e-12."""
    from kiln.launch.testing import run_distributed

    stages = {f: (0, 1 + i % 2, 3) for i, f in enumerate(FAMILIES)}
    cases = [(f, [f"parallel.zero={z}", "train.max_steps=4"]) for f in FAMILIES for z in stages[f]]
    cases += [(f, ["parallel.tp=2", "train.max_steps=4"]) for f in PLANNED]
    fp64 = [(f, [f"parallel.zero={z}", *FP64[f]]) for f in FP64 for z in (0, 2)]
    results = run_distributed(_in_two_processes, 2, str(tmp_path / "two"), cases + fp64, timeout_s=900)[0]
    ones: dict[str, tuple] = {}
    for i, (family, extra) in enumerate(cases):
        if family not in ones:
            run = _train(tmp_path, family, "train.max_steps=4")
            ones[family] = (_losses(run), json.loads((run / "summary.json").read_text())["eval"])
        losses, evaluation, status = results[i]
        ref_losses, ref_eval = ones[family]
        assert status == "completed" and _max_rel(losses, ref_losses) < 1e-4, (family, extra, losses, ref_losses)
        assert evaluation.keys() == ref_eval.keys(), (family, extra, evaluation, ref_eval)
        assert _max_rel(list(evaluation.values()), list(ref_eval.values())) < 1e-5, (family, extra, evaluation)
    for i, (family, extra) in enumerate(fp64, start=len(cases)):
        _assert_same_fp64_training(_train(tmp_path, family, *FP64[family]), tmp_path / "two" / f"case{i}")


# ---- 4. nanoGPT's forward contract ----------------------------------------------------------------

NANO = '''
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import LazyCall as L


class NanoLM(nn.Module):
    """nanoGPT's contract: forward(idx, targets=None) -> (logits, loss); without targets only the
    last position's logits and no loss (written here, not copied)."""

    def __init__(self, vocab=256, width=32, depth=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets=None):
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


model = L(NanoLM)()
data = dict(name="text_lm", batch_size=12, eval_batch_size=24, args=dict(seq_len=16, num_samples=96))
optim = dict(name="adamw", lr=3e-3, weight_decay=0.1, no_decay_1d=False, schedule="constant", betas=[0.9, 0.95])
train = dict(max_steps=10, log_every=1, eval_every=0, precision="fp32", progress="none", clip_grad_norm=1.0,
             pass_targets=True)
'''


def test_a_model_with_nanogpts_forward_contract_trains_with_pass_targets(tmp_path, capsys):
    config = tmp_path / "nano.py"
    config.write_text(NANO)
    out = tmp_path / "runs"
    assert main(["train", str(config), f"train.output_dir={out}"]) == 0
    (run,) = out.iterdir()
    got = _losses(run)
    # by hand: the same model, data order and clip, torch.optim.AdamW
    import importlib.util

    from kiln.data import build_dataset

    spec = importlib.util.spec_from_file_location("nano_by_hand", config)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    torch.manual_seed(0)
    splits = build_dataset("text_lm", seed=0, seq_len=16, num_samples=96)
    model = nano.NanoLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    ref, epoch = [], 0
    while len(ref) < 10:
        order = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(epoch))
        for i in range(len(splits.train) // 12):
            x, y = (torch.stack(t) for t in zip(*(splits.train[int(j)] for j in order[i * 12:(i + 1) * 12])))
            logits, loss = model(x, y)  # (logits, loss): the loss found by what it is
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ref.append(loss.item())
            if len(ref) == 10:
                break
        epoch += 1
    assert _max_rel(got, ref) < 1e-5, (got, ref)
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval"]) == {"loss", "accuracy", "perplexity"}

    # without train.pass_targets kiln calls model(x): one line naming the shapes and the key
    capsys.readouterr()
    assert main(["train", str(config), f"train.output_dir={tmp_path / 'no'}", "train.pass_targets=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(12, 1, 256)" in err[0] and "(12, 16)" in err[0] and "train.pass_targets=true" in err[0]


def test_the_loss_is_found_by_what_it_is_wherever_it_stands_in_a_tuple():
    from kiln.train._tasks import split_outputs

    logits, loss = torch.randn(2, 3, 5), torch.tensor(0.7)
    assert split_outputs((logits, loss)) == (loss, logits)  # nanoGPT
    assert split_outputs((loss, logits, (torch.randn(2, 2),))) == (loss, logits)  # return_dict=False
    assert split_outputs((logits, None)) == (None, logits)  # nanoGPT without targets
    assert split_outputs((None, logits)) == (None, logits)


# ---- 5. a config's keyword arguments ---------------------------------------------------------------

KWARGS = '''
from transformers import GPT2Config, GPT2ForSequenceClassification, T5Config, T5ForConditionalGeneration

from kiln.config import LazyCall as L

model = L(GPT2ForSequenceClassification)(config=L(GPT2Config)(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                              num_labels=4, pad_token_id=0))
seq2seq = L(T5ForConditionalGeneration)(config=L(T5Config)(num_layers=1, d_model=32, d_kv=8, d_ff=32, num_heads=2,
                                                           vocab_size=64, decoder_start_token_id=0))
data = dict(name="digits")
train = dict(max_steps=1)
'''


def test_keyword_arguments_a_config_class_takes_through_kwargs_are_accepted(tmp_path):
    from kiln.config import ConfigError, instantiate, load_config

    path = tmp_path / "kwargs.py"
    path.write_text(KWARGS.replace("seq2seq = ", "_t5 = "))
    cfg = load_config(path)
    assert instantiate(cfg.model).config.num_labels == 4
    path.write_text(KWARGS.replace("model = ", "_gpt2 = ").replace("seq2seq = ", "model = "))
    assert instantiate(load_config(path).model).config.decoder_start_token_id == 0
    # a typo is still caught where the signature is closed
    with pytest.raises(ConfigError, match=r"unknown key data.famly.*data.family"):
        load_config(CONFIG, ["data.famly=t5"])


# ---- 7. the clip's norm over a long arena --------------------------------------------------------

def test_the_clips_norm_over_a_long_arena_matches_fp64():
    import kiln.optim

    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(26_000_000)), nn.Parameter(torch.zeros(1000, 3))]
    opt = kiln.optim.AdamW(params, lr=1e-3)
    for p in params:  # small positive gradients: every term of the sum adds up, the worst case
        p.grad.copy_(torch.rand(p.shape) * 1e-3 + 1e-3)
    exact = torch.cat([p.grad.double().flatten() for p in params]).norm()
    one_pass = torch.cat([p.grad.flatten() for p in params]).norm().double()
    assert abs(one_pass - exact) / exact > 1e-4  # what one fp32 reduction over the arena gives
    norm = kiln.optim.clip_grad_norm_(opt, max_norm=1.0)
    assert abs(norm.double() - exact) / exact < 1e-6
    clipped = torch.cat([p.grad.double().flatten() for p in params]).norm()
    assert abs(clipped - 1.0) < 1e-5


# ---- 8. what a run logs ------------------------------------------------------------------------------

def test_the_logged_lr_is_the_rate_the_step_ran_at(tmp_path):
    run = _train(tmp_path, "user", "train.max_steps=7", "optim.warmup_steps=5")
    rows = read_metrics(run)
    assert [float(r["lr"]) for r in rows] == pytest.approx([1e-2 * min(s, 5) / 5 for s in range(1, 8)])


@pytest.mark.e2e
def test_with_compile_the_compiling_step_is_not_counted_as_speed(tmp_path):
    run = _train(tmp_path, "user", "train.max_steps=6", "train.compile=true")
    rows = read_metrics(run)
    assert rows[0]["samples_per_second"] in ("", None)  # step 1 is the compile: no speed to report
    speeds = [float(r["samples_per_second"]) for r in rows[1:]]
    summary = json.loads((run / "summary.json").read_text())
    # the compile is the first step's time, longer than any compiled step's (each took 16 / speed s)
    assert summary["compile_seconds"] == summary["first_step_seconds"] > 16 / min(speeds)
    # the summary's speed is the timed steps' (5 of 16 samples each), near the logged ones
    assert min(speeds) / 3 < summary["samples_per_second"] < max(speeds) * 3


@pytest.mark.parametrize("name", ["LAMB", "LARS"])
def test_lamb_and_lars_trust_ratios_over_a_long_tensor_match_fp64(name):
    """The per-tensor norms of a 26 M-element tensor, summed from 16-element rows (a 3-element
    tensor beside it sets the rows' length): the ratio, and so the update's scale, to 1e-6."""
    import kiln.optim

    torch.manual_seed(0)
    w, small = torch.randn(26_000_000) * 0.02 + 0.01, torch.randn(3)
    g = torch.rand(26_000_000) * 1e-3 + 1e-3
    deltas = {}
    for dtype in (torch.float32, torch.float64):
        params = [nn.Parameter(w.to(dtype)), nn.Parameter(small.to(dtype))]
        opt = getattr(kiln.optim, name)(params, lr=1e-2, weight_decay=0.01)
        ((params[0] * g.to(dtype)).sum() + params[1].sum() * 1e-3).backward()
        before = params[0].detach().clone()
        opt.step()
        deltas[dtype] = (params[0].detach() - before).double()
        del opt, params
    d32, d64 = deltas[torch.float32], deltas[torch.float64]
    scale = (d32 * d64).sum() / (d64 * d64).sum()  # the fp32 update's scale against fp64's
    assert abs(scale.item() - 1) < 1e-6


@pytest.mark.parametrize("compile", [None, False], ids=["native", "eager"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_with_eps_0_on_padded_segments_matches_the_per_tensor_rule(compile, wd):
    """The held-out check of issue 25: LAMB(eps=0) on a (20, 20) weight, a 7-element vector and a
    0-d tensor, 20 fp64 steps. The vector's and the scalar's segments end in alignment padding,
    whose u is 0/0 with eps = 0: it must take no part in the norms (it made the ratio 1: the
    vector 6.4% off, the scalar 2.9%) and the padding must stay zero."""
    import kiln.optim
    from test_optim import _ref_lamb

    torch.manual_seed(0)
    init = [torch.randn(20, 20, dtype=torch.float64), torch.randn(7, dtype=torch.float64),
            torch.randn((), dtype=torch.float64)]
    params = [nn.Parameter(t.clone()) for t in init]
    opt = kiln.optim.LAMB(params, lr=1e-2, eps=0.0, weight_decay=wd, compile=compile)
    ref, state = [t.clone() for t in init], {}
    for t in range(1, 21):
        grads = [torch.randn_like(w) + 0.1 for w in init]  # nowhere zero: 0/0 only in the padding
        for p, g in zip(params, grads):
            p.grad = None
        sum((p * g).sum() for p, g in zip(params, grads)).backward()
        opt.step()
        _ref_lamb(ref, grads, state, 1e-2, 0.9, 0.999, 0.0, wd, t)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-13, atol=1e-13)
    (arena,) = opt.arenas
    real = torch.zeros(arena.numel, dtype=torch.bool)
    for o, n in zip(arena.offsets.tolist(), arena.numels):
        real[o:o + n] = True
    assert arena.param[~real].eq(0).all() and not arena.param.isnan().any()
