"""The chunked LM head and loss (``train.chunked_lm_loss``, kiln/train/_chunked_loss.py): the same
loss, gradients and evaluation as whole logits (fp32, fp64, bf16 autocast, padding, bias, tied
embeddings, several chunks and a ragged last one), the models it applies to, the config's
refusals, whole runs, and tensor parallelism on gloo.

Numbers compared here pin ``train.precision``. Chunks are made small (``_small_chunks``) so
that a few dozen rows run as several chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln.train._chunked_loss as chunked
from kiln.commands import main
from kiln.models import create_model
from kiln.train._chunked_loss import apply_chunked_head, chunked_cross_entropy, chunked_eval_sums, head_path
from kiln.train._tasks import Task, micro_batch_loss

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "configs" / "gpt_tiny.py")
ARCH = dict(dim=32, depth=2, heads=4, seq_len=16, vocab_size=256, dropout=0.0)
# relative to the largest entry of the reference: fp32 rounding of another summation order
TOL = {torch.float32: 1e-6, torch.float64: 1e-13}


def _small_chunks(monkeypatch, rows: int = 16) -> None:
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 1)
    monkeypatch.setattr(chunked, "MIN_ROWS", rows)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> None:
    """``got`` equals ``ref`` to TOL of ``scale`` (default: the largest entry of ``ref``)."""
    err = (got - ref).abs().max() / (scale if scale is not None else ref.abs().max())
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def _grads_close(model: nn.Module, ref_model: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter's gradient, to TOL of the largest gradient entry of the model (the key
    biases' gradients are mathematically 0: their values are rounding noise on either side)."""
    grads = dict(model.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref_model.parameters())
    for name, p in ref_model.named_parameters():
        _close(grads[name].grad, p.grad, dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_the_chunked_loss_and_gradients_are_those_of_whole_logits(monkeypatch, dtype, bias):
    _small_chunks(monkeypatch)  # 70 rows: chunks of 16, the last of 6; one chunk wholly padded
    g = torch.Generator().manual_seed(0)
    h = torch.randn(70, 24, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(300, 24, dtype=dtype, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(300, dtype=dtype, generator=g) * 0.3).requires_grad_() if bias else None
    y = torch.randint(300, (70,), generator=g)
    y[::3] = -100
    y[16:32] = -100
    leaves = [t for t in (h, w, b) if t is not None]
    got = chunked_cross_entropy(h, w, b, y)
    got_grads = torch.autograd.grad(got * 3, leaves)  # (an incoming gradient other than 1)
    ref = F.cross_entropy(F.linear(h, w, b), y)
    ref_grads = torch.autograd.grad(ref * 3, leaves)
    assert got.dtype == dtype
    _close(got, ref, dtype)
    for a, r in zip(got_grads, ref_grads):
        _close(a, r, dtype)


def _fused_on_cpu(monkeypatch, kernel) -> list[int]:
    """The GPU's fused chunk path taken on this CPU, with ``kernel`` as its compiled function;
    returns a list that grows by one each chunk the kernel computes."""
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(chunked, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(chunked, "_COMPILED", [counted])
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gpu_s_fused_chunk_gives_the_loss_and_gradients_of_whole_logits(monkeypatch, dtype):
    """The function a GPU compiles for each chunk (softmax, loss and gradient in one), run eagerly
    here, over chunks with padded rows and a bias: whole logits' loss and gradients."""
    _small_chunks(monkeypatch)
    calls = _fused_on_cpu(monkeypatch, chunked._softmax_grad)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(70, 24, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(300, 24, dtype=dtype, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(300, dtype=dtype, generator=g) * 0.3).requires_grad_()
    y = torch.randint(300, (70,), generator=g)
    y[::3] = -100
    y[16:32] = -100
    got = chunked_cross_entropy(h, w, b, y)
    got_grads = torch.autograd.grad(got * 3, (h, w, b))
    ref = F.cross_entropy(F.linear(h, w, b), y)
    ref_grads = torch.autograd.grad(ref * 3, (h, w, b))
    assert len(calls) == 5 and got.dtype == dtype  # 70 rows in chunks of 16
    _close(got, ref, dtype)
    for a, r in zip(got_grads, ref_grads):
        _close(a, r, dtype)


def test_the_fused_chunk_is_left_under_a_dispatch_mode_and_under_bf16_matches_the_eager_chunks(monkeypatch):
    """Under a dispatch mode (the first step's FLOP count) the eager chunk path runs: dynamo
    meeting the mode would compile its handler instead. Under bf16 autocast the fused function
    gives the eager chunks' loss and gradients (the same bf16 products, softmax in fp32)."""
    from kiln.hardware.flops import CountFlops

    _small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(64, 32, generator=g).requires_grad_()
    w = (torch.randn(200, 32, generator=g) * 0.2).requires_grad_()
    y = torch.randint(200, (64,), generator=g)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_cross_entropy(h, w, None, y)
        return loss, torch.autograd.grad(loss, (h, w))

    eager_loss, eager_grads = run()
    calls = _fused_on_cpu(monkeypatch, chunked._softmax_grad)
    with CountFlops() as counted:
        counted_loss, _ = run()
    assert calls == [] and counted.total > 0 and torch.equal(counted_loss, eager_loss)
    fused_loss, fused_grads = run()
    assert len(calls) == 4
    assert abs(fused_loss - eager_loss) < 1e-6
    for a, r in zip(fused_grads, eager_grads):
        assert (a - r).abs().max() / r.abs().max() < 1e-2  # (bf16 gradients of the logits, rounded apart)


def test_a_gpu_s_chunks_are_large_and_even():
    assert chunked.chunk_rows(50304) == 640  # a CPU's: 123 MiB of fp32 logits
    assert chunked.chunk_rows(50304, 16384, "cuda") == 4096  # GPT-2 small's 16 x 1024: 4 chunks, not 26
    assert chunked.chunk_rows(50304, 5000, "cuda") == 5000  # under CUDA_CHUNK_BYTES: one chunk
    assert chunked.chunk_rows(128256, 16384, "cuda") == 2048  # Llama 3's vocabulary: 8 of 2048


@pytest.mark.e2e
def test_the_fused_chunk_compiled_by_inductor_matches_the_eager_chunks(monkeypatch):
    """The compiled kernel itself (inductor's C++ here, Triton on a GPU), shapes dynamic: one
    compile serves chunks of 16 rows and the last of 6."""
    _small_chunks(monkeypatch)
    calls = _fused_on_cpu(monkeypatch, torch.compile(chunked._softmax_grad, dynamic=True))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(70, 24, generator=g).requires_grad_()
    w = (torch.randn(300, 24, generator=g) * 0.3).requires_grad_()
    y = torch.randint(300, (70,), generator=g)
    y[::5] = -100
    got = chunked_cross_entropy(h, w, None, y)
    got_grads = torch.autograd.grad(got, (h, w))
    ref = F.cross_entropy(F.linear(h, w), y)
    ref_grads = torch.autograd.grad(ref, (h, w))
    assert len(calls) == 5
    _close(got, ref, torch.float32)
    for a, r in zip(got_grads, ref_grads):
        assert (a - r).abs().max() / r.abs().max() < 1e-5
    torch._dynamo.reset()


def test_evaluation_sums_loss_and_accuracy_with_ties_to_the_lowest_id(monkeypatch):
    _small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 8, dtype=torch.float64, generator=g)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g)
    w[7] = w[30] = w[3] * 10  # a tie for the largest logit in most rows: argmax takes the lowest id (3)
    y = torch.randint(50, (40,), generator=g)
    y[:10] = 3
    y[-4:] = -100
    loss, correct, scored = chunked_eval_sums(h, w, None, y)
    logits = h @ w.t()
    keep = y != -100
    assert scored == keep.sum() == 36
    assert correct == ((logits.argmax(-1) == y) & keep).sum() > 0
    torch.testing.assert_close(loss, F.cross_entropy(logits, y, reduction="sum"), rtol=1e-13, atol=0)


def test_under_bf16_autocast_the_matmuls_run_in_bf16_and_the_softmax_in_fp32(monkeypatch):
    _small_chunks(monkeypatch)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(64, 32, generator=g).requires_grad_()
    w = (torch.randn(200, 32, generator=g) * 0.2).requires_grad_()
    y = torch.randint(200, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_cross_entropy(h, w, None, y)
        ref = F.cross_entropy(F.linear(h, w).float(), y)  # kiln's upcast of bf16 logits
    exact = F.cross_entropy(F.linear(h, w), y)  # all fp32
    got_grads, ref_grads = torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))
    assert got.dtype == torch.float32 and all(t.dtype == torch.float32 for t in got_grads)
    # the same bf16 products: equal to autocast's whole logits far closer than to fp32's
    assert abs(got - ref) < 1e-5 < abs(got - exact)
    for a, r in zip(got_grads, ref_grads):
        assert (a - r).abs().max() / r.abs().max() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tie", [False, True])
def test_a_gpt_with_the_chunked_head_trains_as_with_its_own(monkeypatch, dtype, tie):
    """Every parameter's gradient, the tied embedding's included: the head's part accumulates
    into the one weight the embedding also writes."""
    _small_chunks(monkeypatch)
    torch.manual_seed(0)
    ref_model = create_model("gpt", **ARCH, tie_embeddings=tie).to(dtype)
    model = create_model("gpt", **ARCH, tie_embeddings=tie).to(dtype)
    model.load_state_dict(ref_model.state_dict())
    head = apply_chunked_head(model, "head.out")
    assert (model.head.out.weight is model.embed.tok.weight) == tie
    ids = torch.randint(256, (4, 16))
    targets = torch.randint(256, (4, 16))
    targets[1, 5:] = -100  # padding
    task = Task(kind="lm", head=head)
    loss = micro_batch_loss(task, model, (ids, targets))
    loss.backward()
    ref = micro_batch_loss(Task(kind="lm"), ref_model, (ids, targets))
    ref.backward()
    _close(loss, ref, dtype)
    _grads_close(model, ref_model, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_hugging_face_mapping_batch_with_padding_is_scored_as_whole_logits(monkeypatch, dtype):
    """GPT-2 on a padded mapping batch: with the chunked head kiln calls it without labels and
    scores its hidden states (shifted by one, padding not scored) as whole logits are scored:
    in fp32 against the model's own loss (given labels), in fp64 against kiln's cross-entropy of
    the model's logits (the model's own loss is computed in fp32 whatever the model's dtype)."""
    transformers = pytest.importorskip("transformers")
    _small_chunks(monkeypatch)
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref_model = transformers.GPT2LMHeadModel(config).to(dtype)
    model = transformers.GPT2LMHeadModel(config).to(dtype)
    model.load_state_dict(ref_model.state_dict())
    assert head_path(model) == "lm_head"
    head = apply_chunked_head(model, "lm_head")
    ids = torch.randint(96, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    loss = micro_batch_loss(Task(kind="lm", head=head), model, batch)
    loss.backward()
    if dtype == torch.float64:
        batch = {k: v for k, v in batch.items() if k != "labels"}  # kiln scores the logits itself
    ref = micro_batch_loss(Task(kind="lm"), ref_model, batch)
    ref.backward()
    _close(loss, ref, dtype)
    _grads_close(model, ref_model, dtype)


def test_which_heads_are_declared_or_recognised():
    transformers = pytest.importorskip("transformers")
    assert head_path(create_model("gpt", depth=1)) == "head.out"
    assert head_path(create_model("bert", depth=1)) is None  # masked LM: not declared
    assert head_path(create_model("vit", depth=1)) is None
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert head_path(llama) == "lm_head"
    # not declared by a plan: recognised by get_output_embeddings(), unless logits are changed after it
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert head_path(neox) == "lm_head" and head_path(neox, recognise=False) is None
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8))
    assert gemma.config.final_logit_softcapping is not None and head_path(gemma) is None


class _ScaledLogits(nn.Module):
    """A model whose plan declares ``out`` but which scales its logits after it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.out = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids)) * 2


def test_logits_changed_after_a_declared_head_are_refused_not_mis_scored():
    head = apply_chunked_head(model := _ScaledLogits(), "out")
    with pytest.raises(ValueError, match="changed before the model returns it"):
        micro_batch_loss(Task(kind="lm", head=head), model, (torch.zeros(2, 4, dtype=torch.long),) * 2)


def test_auto_makes_whole_logits_below_its_size_and_chunks_above(monkeypatch):
    calls = []
    real = chunked.chunked_cross_entropy
    monkeypatch.setattr(chunked, "chunked_cross_entropy", lambda *a: calls.append(1) or real(*a))
    model = create_model("gpt", **ARCH)
    head = apply_chunked_head(model, "head.out", min_bytes=4 * 256 * 64)  # 64 rows' fp32 logits
    task = Task(kind="lm", head=head)
    for rows in (2, 8):  # batches of 2 x 16 and 8 x 16 rows
        ids = torch.randint(256, (rows, 16))
        micro_batch_loss(task, model, (ids, ids)).backward()
    assert calls == [1]  # only the 128-row batch
    ids = torch.randint(256, (2, 16))  # evaluation alike: whole logits as kiln scores them, here
    whole = head.eval_sums(model(ids), ids)
    head.min_bytes = 0
    for got, ref in zip(chunked_eval_sums(model(ids), model.head.out.weight, None, ids), whole):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("config,overrides,why", [
    (GPT, ["train.loss=torch.nn.functional.l1_loss"], "train.loss is set"),
    (GPT, ["train.metrics={acc: torch.nn.functional.l1_loss}"], "train.metrics is set"),
    (GPT, ["train.pass_targets=true"], "the model computes its own loss"),
    (GPT, ["parallel.pp=2", "model.tie_embeddings=false", "--nproc", "2"], "parallel.pp=2"),
    (GPT, ["data.task=classification"], "the task is classification"),
    (str(ROOT / "configs" / "bert_tiny.py"), [], "BERT declares no output projection"),
    (str(ROOT / "configs" / "digits_vit.py"), [], "ViT declares no output projection"),
])
def test_true_where_it_cannot_apply_is_one_line_naming_why(tmp_path, capsys, config, overrides, why):
    code = main(["train", config, "train.chunked_lm_loss=true", "train.max_steps=1", "train.precision=fp32",
                 f"train.output_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.chunked_lm_loss=true cannot apply" in err and why in err, err
    assert not any(tmp_path.iterdir())  # refused before a run directory was made


def _losses(run: Path) -> list[float]:
    rows = (run / "metrics.csv").read_text().splitlines()
    col = rows[0].split(",").index("train_loss")
    return [float(r.split(",")[col]) for r in rows[1:]]


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [["model.tie_embeddings=true"], ["train.compile=true"]], ids=["tied", "compile"])
def test_kiln_train_with_and_without_the_chunked_loss_trains_the_same(tmp_path, monkeypatch, extra):
    _small_chunks(monkeypatch, rows=64)  # 8 x 64 = 512 rows a step: 8 chunks
    runs = {}
    for setting in ("false", "true"):
        out = tmp_path / setting
        assert main(["train", GPT, "train.precision=fp32", "train.max_steps=5", "train.log_every=1",
                     "train.eval_every=5", "data.batch_size=8", f"train.output_dir={out}",
                     f"train.chunked_lm_loss={setting}", *extra]) == 0
        (runs[setting],) = out.iterdir()
    plain, chunk = (_losses(runs[s]) for s in ("false", "true"))
    assert len(plain) == 5
    assert chunk == pytest.approx(plain, rel=2e-6)  # (metrics.csv keeps 6 significant digits)
    ev = {s: json.loads((runs[s] / "summary.json").read_text())["eval"] for s in runs}
    assert ev["true"]["accuracy"] == ev["false"]["accuracy"]
    assert ev["true"]["loss"] == pytest.approx(ev["false"]["loss"], rel=1e-6)


@pytest.mark.distributed
def test_zero3_keeps_the_heads_weight_gathered_for_the_chunked_loss(tmp_path):
    """FSDP2 would reshard the root's parameters after its forward, before the loss reads the
    head's weight: kiln keeps them gathered until the backward, and trains as with whole logits.
    Both runs in one pair of processes started once (tests/group_runs.py)."""
    from group_runs import train_in_one_group

    settings = ("false", "true")
    common = ["parallel.zero=3", "train.precision=fp32", "train.max_steps=3", "train.log_every=1", "train.eval_every=3",
              "data.batch_size=8", "model.tie_embeddings=true"]
    dirs = train_in_one_group(2, [(GPT, [*common, f"train.output_dir={tmp_path / s}", f"train.chunked_lm_loss={s}"])
                                  for s in settings])
    runs = dict(zip(settings, dirs))
    assert _losses(runs["true"]) == pytest.approx(_losses(runs["false"]), rel=2e-6)
    ev = {s: json.loads((runs[s] / "summary.json").read_text())["eval"] for s in runs}
    assert ev["true"]["loss"] == pytest.approx(ev["false"]["loss"], rel=1e-6)


# -- tensor parallelism, 2 gloo processes -------------------------------------------------------
def _tp_rank(rank, world, tie, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from kiln.parallel._tp import apply_tp

    chunked.CHUNK_BYTES, chunked.MIN_ROWS = 1, 16  # 64 rows: 4 chunks
    torch.manual_seed(0)
    model = create_model("gpt", **ARCH, tie_embeddings=tie)
    apply_tp(model, init_device_mesh("cpu", (world,)), sequence_parallel=sp, chunked_head=True)
    head = apply_chunked_head(model, "head.out")
    ids, targets = _tp_batch()
    loss = micro_batch_loss(Task(kind="lm", head=head), model, (ids, targets))
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    with torch.no_grad():
        sums = head.eval_sums(model(ids), targets)
    return {"loss": loss.detach(), "grads": grads, "sums": sums, "local_rows": model.head.out.weight.to_local().shape[0],
            "tied": model.head.out.weight is model.embed.tok.weight}


def _tp_batch():
    g = torch.Generator().manual_seed(5)
    ids, targets = torch.randint(256, (4, 16), generator=g), torch.randint(256, (4, 16), generator=g)
    targets[2, 3:] = -100
    return ids, targets


@pytest.mark.distributed
@pytest.mark.parametrize("tie,sp", [(False, False), (True, True)], ids=["untied", "tied-sequence-parallel"])
def test_tensor_parallel_chunks_each_ranks_vocabulary_and_matches_one_process(tie, sp):
    from kiln.launch.testing import run_distributed

    torch.manual_seed(0)
    ref_model = create_model("gpt", **ARCH, tie_embeddings=tie)
    ids, targets = _tp_batch()
    ref = micro_batch_loss(Task(kind="lm"), ref_model, (ids, targets))
    ref.backward()
    logits = ref_model(ids).flatten(0, 1)
    y = targets.flatten()
    ref_sums = (F.cross_entropy(logits, y, reduction="sum"), ((logits.argmax(-1) == y) & (y != -100)).sum())
    for out in run_distributed(_tp_rank, 2, tie, sp):
        assert out["local_rows"] == 128 and out["tied"] == tie  # each rank holds half the vocabulary
        _close(out["loss"], ref.detach(), torch.float32)
        scale = max(float(p.grad.abs().max()) for p in ref_model.parameters())
        for name, p in ref_model.named_parameters():
            _close(out["grads"][name], p.grad, torch.float32, scale)
        _close(out["sums"][0], ref_sums[0].detach(), torch.float32)
        assert out["sums"][1] == ref_sums[1] and out["sums"][2] == (y != -100).sum()
