"""Tensor parallelism (``apply_tp``) on GPT and BERT: parity with one process, fp32.

Two spawns carry all distributed work: 2 gloo processes (tp=2: with and without sequence
parallelism, loss_parallel off, tied embeddings, pipeline stages, LAMB, clipping, evaluation)
and 4 (dp=2 x tp=2: FSDP2 over dp, and gradients all-reduced over dp). The one-process
references are computed here, in the test process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln.models
import kiln.optim as ko
from kiln.data._text import mask_tokens
from kiln.launch.testing import run_distributed
from kiln.parallel._tp import check_tp

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

ARCH = dict(dim=32, depth=2, heads=4, seq_len=16, vocab_size=256, dropout=0.0)
B, T, STEPS = 4, 16, 3
# eps=1e-4: the key bias's gradient is mathematically zero (softmax ignores a constant added
# to every score), so its value on either side is fp32 rounding noise (~1e-9). Adam's
# g / (|g| + eps) turns noise into updates of up to lr; with eps=1e-4 such an update is at
# most lr * 1e-9 / 1e-4 = 1e-8, and the runs stay comparable to 1e-5 for all 3 steps.
OPT = dict(lr=1e-3, eps=1e-4, weight_decay=0.1)
LAMB = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)  # eps: as for OPT
CLIP = 1.0  # below the initial gradient norm (~1.5): clipping is active
# rtol=1e-5 as asked; atol=1e-7 covers elements whose true value is ~0 (the key bias gradient
# above, tiny gradients of rare tokens), where TP's other summation order leaves a difference
# of a few fp32 ulps of the tensor's largest entries (measured: at most ~3e-8 beyond rtol).
TOL = dict(rtol=1e-5, atol=1e-7)


def _model(name, **kw):
    torch.manual_seed(0)
    return kiln.models.create_model(name, **ARCH, **kw)


def _batch(name, step):
    """The global batch of one step: GPT random next tokens; BERT kiln's masking (a fixed number
    of scored positions per sequence, so per-rank mean losses average to the global one)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(256, (B, T), generator=g)
    if name == "gpt":
        return ids, torch.randint(256, (B, T), generator=g)
    return mask_tokens(ids, 0.25, g)


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(name, model, opt, *, rows=slice(None), tp_loss=True, dp_sync=None, clip_fn=None):
    """STEPS optimizer steps; returns losses, every step's full gradients (after any sync and
    clipping to CLIP: what the optimizer steps), clip norms and the final full parameters."""
    from kiln.parallel import all_reduce_gradients
    from kiln.parallel._tp import tp_loss_context

    losses, grads, norms = [], [], []
    for s in range(STEPS):
        ids, y = _batch(name, s)
        with tp_loss_context(tp_loss):
            # as kiln.train's loss_fn; under loss_parallel the logits and the loss are DTensors
            loss = F.cross_entropy(model(ids[rows]).flatten(0, -2).float(), y[rows].flatten())
            loss.backward()
        if dp_sync is not None:
            all_reduce_gradients(model.parameters(), dp_sync)
        if clip_fn is not None:
            norms.append(float(clip_fn(model.parameters(), CLIP)))
        losses.append(loss.item())
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, norms=norms,
                params={n: _full(p) for n, p in model.named_parameters()})


@functools.cache  # shared by several tests: read only
def _reference(name, opt="AdamW", **kw):
    """One process, the whole batch, torch's clip_grad_norm_."""
    model = _model(name, **kw)
    kwargs = OPT if opt == "AdamW" else LAMB
    return _train(name, model, getattr(ko, opt)(model.parameters(), contiguous=False, **kwargs),
                  tp_loss=False, clip_fn=torch.nn.utils.clip_grad_norm_)


def _tp_train(name, model, opt="AdamW", **kw):
    from kiln.parallel import clip_grad_norm_

    kwargs = OPT if opt == "AdamW" else LAMB
    return _train(name, model, getattr(ko, opt)(model.parameters(), contiguous=False, **kwargs),
                  clip_fn=clip_grad_norm_, **kw)


def _layout(model):
    """name -> (placements as strings, or None for a plain tensor; local shape; grad's placements)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[n] = (tuple(map(repr, p.placements)), tuple(p.to_local().shape))
        else:
            out[n] = (None, tuple(p.shape))
    return out


def _grad_layout(model):
    from torch.distributed.tensor import DTensor

    return {n: (tuple(map(repr, p.grad.placements)), tuple(p.grad.to_local().shape)) if isinstance(p.grad, DTensor)
            else (None, tuple(p.grad.shape)) for n, p in model.named_parameters()}


def _assert_same(got, ref, what):
    assert got.keys() == ref.keys(), what
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=lambda m, k=k: f"{what} {k}: {m}")


def _assert_run(got, ref, what, norms=True):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
    for s in range(STEPS):
        _assert_same(got["grads"][s], ref["grads"][s], f"{what} step {s} grad")
    _assert_same(got["params"], ref["params"], f"{what} params")
    if norms:
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), what


# -- tp=2 -------------------------------------------------------------------------------------
def _tp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.parallel._tp import apply_tp, gather_logits, tp_loss_context

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in ("gpt", "bert"):
        for sp in (False, True):
            model = apply_tp(_model(name), mesh, sequence_parallel=sp)
            layout = _layout(model)
            shapes = {}  # what flows between the pieces: the residual stream and the logits
            model.blocks[0].register_forward_hook(
                lambda m, a, o, shapes=shapes: shapes.update(block=(type(o).__name__, tuple(o.shape))))
            ids, _ = _batch(name, 0)
            with tp_loss_context(True):
                logits = model(ids)
            shapes["logits"] = (tuple(map(repr, logits.placements)), tuple(logits.to_local().shape))
            run = _tp_train(name, model)
            model.eval()
            with torch.inference_mode():  # evaluation: accuracy needs the full logits
                run["eval_logits"] = gather_logits(model(_batch(name, STEPS)[0])).clone()
            model.train()
            ids, y = _batch(name, 0)
            with tp_loss_context(True):
                F.cross_entropy(model(ids).flatten(0, -2), y.flatten()).backward()
            out[name, sp] = dict(run=run, layout=layout, grad_layout=_grad_layout(model), shapes=shapes)

    # logits gathered (loss_parallel=False): plain (B, T, V) and plain cross-entropy
    model = apply_tp(_model("bert"), mesh, loss_parallel=False)
    logits = model(_batch("bert", 0)[0])
    out["no_lp_logits"] = (type(logits).__name__, tuple(logits.shape))
    out["no_lp"] = _tp_train("bert", model, tp_loss=False)

    # tied embeddings stay one Parameter (sequence parallel, where it is hardest)
    model = apply_tp(_model("gpt", tie_embeddings=True), mesh, sequence_parallel=True)
    out["tied_is"] = model.head.out.weight is model.embed.tok.weight
    out["tied"] = _tp_train("gpt", model)
    try:  # sequence parallelism needs T divisible by tp
        model(_batch("gpt", 0)[0][:, :15])
    except ValueError as e:
        out["odd_T_error"] = str(e)

    # replicated and sharded values come from tp rank 0, whatever each rank built
    torch.manual_seed(rank)
    model = apply_tp(kiln.models.create_model("bert", **ARCH), mesh, sequence_parallel=True)
    out["init"] = {n: _full(p) for n, p in model.named_parameters()}

    # LAMB's per-tensor trust ratios over TP shards (norms of the full tensors)
    model = apply_tp(_model("gpt"), mesh, sequence_parallel=True)
    out["lamb"] = _tp_train("gpt", model, "LAMB")

    # pipeline stages (parts replaced by nn.Identity): stage 0 = embed + block 0, stage 1 =
    # block 1 + head; the sequence shard of stage 0's output feeds stage 1 directly
    for sp in (False, True):
        s0, s1 = _model("bert"), _model("bert")
        s0.head, s0.blocks[1] = nn.Identity(), nn.Identity()
        s1.embed, s1.blocks[0] = nn.Identity(), nn.Identity()
        apply_tp(s0, mesh, sequence_parallel=sp)
        apply_tp(s1, mesh, sequence_parallel=sp)
        ids, y = _batch("bert", 0)
        with tp_loss_context(True):
            h = s0(ids)
            F.cross_entropy(s1(h).flatten(0, -2), y.flatten()).backward()
        grads = {n: _full(p.grad) for s in (s0, s1) for n, p in s.named_parameters()}
        out["pp", sp] = (tuple(h.shape), grads)
    return out


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_tp_worker, 2)


def _expected_layout(name, sp):
    """The Megatron layout, local shapes at tp=2 (C=32, F=128, V=256)."""
    rep = ("Replicate()",) if sp else None  # norms (and BERT's dense): replicated DTensors under SP
    s0, s1, r = ("Shard(dim=0)",), ("Shard(dim=1)",), ("Replicate()",)
    exp = {"embed.tok.weight": (s0, (128, 32)), "embed.pos.weight": (None, (16, 32))}
    if name == "bert":
        exp.update({"embed.norm.weight": (rep, (32,)), "embed.norm.bias": (rep, (32,))})
    for i in range(2):
        b = f"blocks.{i}"
        for n in ("norm1", "norm2"):
            exp.update({f"{b}.{n}.weight": (rep, (32,)), f"{b}.{n}.bias": (rep, (32,))})
        for w in ("wq", "wk", "wv"):
            exp.update({f"{b}.attn.{w}.weight": (s0, (16, 32)), f"{b}.attn.{w}.bias": (s0, (16,))})
        exp.update({f"{b}.attn.wo.weight": (s1, (32, 16)), f"{b}.attn.wo.bias": (r, (32,)),
                    f"{b}.mlp.fc1.weight": (s0, (64, 32)), f"{b}.mlp.fc1.bias": (s0, (64,)),
                    f"{b}.mlp.fc2.weight": (s1, (32, 64)), f"{b}.mlp.fc2.bias": (r, (32,))})
    exp.update({"head.norm.weight": (rep, (32,)), "head.norm.bias": (rep, (32,)), "head.out.weight": (s0, (128, 32))})
    if name == "bert":
        for n, shape in (("dense.weight", (32, 32)), ("dense.bias", (32,)),
                         ("transform_norm.weight", (32,)), ("transform_norm.bias", (32,))):
            exp[f"head.{n}"] = (rep, shape)
        exp["head.out.bias"] = (s0, (128,))
    return exp


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_tp2_layout(tp2, name, sp):
    for rank, out in enumerate(tp2):
        res = out[name, sp]
        assert res["layout"] == _expected_layout(name, sp), rank
        # gradients land in their parameter's layout (what kiln.optim steps, shard by shard)
        assert res["grad_layout"] == res["layout"], rank
        # residual stream: (B, T, C) replicated, or this rank's (B, T/2, C) under SP;
        # logits: a DTensor sharded on the vocabulary, (B, T, V/2) here
        assert res["shapes"]["block"] == ("Tensor", (B, T // 2 if sp else T, 32))
        assert res["shapes"]["logits"] == (("Shard(dim=2)",), (B, T, 128))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_tp2_matches_one_process(tp2, name, sp):
    ref = _reference(name)
    ref_model = _model(name)
    ref_model.load_state_dict(ref["params"])
    ref_model.eval()
    with torch.no_grad():
        ref_logits = ref_model(_batch(name, STEPS)[0])
    for out in tp2:
        run = out[name, sp]["run"]
        _assert_run(run, ref, f"{name} sp={sp}")
        torch.testing.assert_close(run["eval_logits"], ref_logits, **TOL)


def test_tp2_without_loss_parallel(tp2):
    ref = _reference("bert")
    for out in tp2:
        assert out["no_lp_logits"] == ("Tensor", (B, T, 256))
        _assert_run(out["no_lp"], ref, "bert loss_parallel=False")


def test_tp2_tied_embeddings(tp2):
    ref = _reference("gpt", tie_embeddings=True)
    assert "head.out.weight" not in ref["params"]  # named_parameters lists a tied one once
    for out in tp2:
        assert out["tied_is"]
        _assert_run(out["tied"], ref, "gpt tied, sp")


def test_tp2_sequence_parallel_needs_divisible_length(tp2):
    for out in tp2:
        assert "15 tokens" in out["odd_T_error"] and "multiple of 2" in out["odd_T_error"]


def test_tp2_parameters_come_from_rank0(tp2):
    ref = {n: p.detach() for n, p in _model("bert").named_parameters()}  # seed 0 = rank 0's
    for out in tp2:
        _assert_same(out["init"], ref, "init")


def test_tp2_lamb(tp2):
    ref = _reference("gpt", opt="LAMB")
    for out in tp2:
        _assert_run(out["lamb"], ref, "gpt LAMB sp")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_tp2_pipeline_stages(tp2, sp):
    ref = _model("bert")
    ids, y = _batch("bert", 0)
    F.cross_entropy(ref(ids).flatten(0, -2), y.flatten()).backward()
    for out in tp2:
        shape, grads = out["pp", sp]
        assert shape == (B, T // 2 if sp else T, 32)
        _assert_same(grads, {n: p.grad for n, p in ref.named_parameters()}, f"pp sp={sp}")


# -- dp=2 x tp=2 ------------------------------------------------------------------------------
def _dp_tp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.parallel._fsdp import apply_fsdp
    from kiln.parallel._tp import apply_tp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    rows = slice(dp * B // 2, (dp + 1) * B // 2)  # this dp rank's half of the global batch
    out = {}
    try:
        apply_tp(_model("gpt"), mesh)
    except ValueError as e:
        out["2d_error"] = str(e)
    for name, mode, sp in (("gpt", "fsdp", False), ("gpt", "allreduce", True),
                           ("bert", "fsdp", True), ("bert", "allreduce", False)):
        model = apply_tp(_model(name), mesh["tp"], sequence_parallel=sp)
        if mode == "fsdp":
            apply_fsdp(model, mesh=mesh["dp"])  # FSDP2 reduce-scatters (averages) over dp
        run = _tp_train(name, model, rows=rows, dp_sync=mesh["dp"].get_group() if mode == "allreduce" else None)
        out[name, mode] = dict(run=run, layout=_layout(model))
    model = apply_fsdp(apply_tp(_model("gpt"), mesh["tp"]), mesh=mesh["dp"])
    out["lamb"] = _tp_train("gpt", model, "LAMB", rows=rows)
    return out


@pytest.fixture(scope="module")
def dp2_tp2():
    return run_distributed(_dp_tp_worker, 4)


@pytest.mark.parametrize("name,mode", [("gpt", "fsdp"), ("gpt", "allreduce"), ("bert", "fsdp"), ("bert", "allreduce")])
def test_dp2_tp2_matches_one_process(dp2_tp2, name, mode):
    ref = _reference(name)
    for rank, out in enumerate(dp2_tp2):
        assert "1-D" in out["2d_error"]
        got = dict(out[name, mode]["run"])
        # each dp rank's loss is the mean over its half; the two halves average to the global one
        dp_partner = dp2_tp2[rank ^ 2]  # ranks (dp, tp) = divmod(rank, 2)
        got["losses"] = [(a + b) / 2 for a, b in zip(got["losses"], dp_partner[name, mode]["run"]["losses"])]
        _assert_run(got, ref, f"{name} {mode} rank {rank}")
        layout = out[name, mode]["layout"]
        wq, wo = layout["blocks.0.attn.wq.weight"], layout["blocks.0.attn.wo.weight"]
        if mode == "fsdp":  # dp shards dim 0 on top of tp's split: a quarter of each matrix
            assert wq == (("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (8, 32))
            assert wo == (("Shard(dim=0)", "Shard(dim=1)"), (16, 16))
        else:
            assert wq == (("Shard(dim=0)",), (16, 32)) and wo == (("Shard(dim=1)",), (32, 16))


# LAMB's trust ratios need norms of whole tensors: over tp shards and, under FSDP2, the
# _StridedShard dp shards on top of them (which are not Placement.is_shard() in torch 2.13).
def test_dp2_tp2_fsdp_lamb(dp2_tp2):
    ref = _reference("gpt", opt="LAMB")
    for out in dp2_tp2:
        _assert_same(out["lamb"]["params"], ref["params"], "gpt FSDP2 x TP LAMB params")


# -- check_tp -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,tp,match", [
    (dict(heads=4), 3, r"parallel.tp=3 does not divide model.heads=4; choose tp in \{1, 2, 4\}"),
    (dict(heads=2, dim=32, mlp_ratio=1.5), 2, None),  # F = 48
    (dict(heads=4, dim=32, mlp_ratio=1.3), 4,
     r"does not divide the feed-forward width round\(model.mlp_ratio\*model.dim\)=42; choose tp in \{1, 2\}"),
    (dict(heads=4, vocab_size=250), 4, r"model.vocab_size=250; choose tp in \{1, 2\}"),
    (dict(), 0, r"parallel.tp=0: must be a positive integer"),
])
def test_check_tp(kw, tp, match):
    cfg = kiln.models.model_config_class("gpt")(**kw)
    if match is None:
        check_tp(cfg, tp)
    else:
        with pytest.raises(ValueError, match=match):
            check_tp(cfg, tp)


def test_check_tp_sequence_parallel_and_other_models():
    cfg = kiln.models.model_config_class("bert")(seq_len=18)
    check_tp(cfg, 4)
    with pytest.raises(ValueError, match=r"model.seq_len=18 \(parallel.sequence_parallel"):
        check_tp(cfg, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="supports the transformer language models"):
        check_tp(kiln.models.model_config_class("mlp")(), 2)
