"""zero=3 (FSDP2 ``apply_fsdp``) parity with kiln's optimizers, and DCP checkpoints that reshard
(between world sizes, ZeRO shards, FSDP2, and pipeline stages that hold part of the model).

Three spawns of 2 gloo processes (1 thread each) carry all distributed work; float64 so the
only differences are reduction orders.
"""

from __future__ import annotations

import json
import pickle
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln.models
import kiln.optim as ko
from kiln.parallel import ZeroOptimizer, all_reduce_gradients, apply_fsdp, clip_grad_norm_, load_sharded, save_sharded
from kiln.launch.testing import run_distributed

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

ARCH = dict(depth=2, dim=32, heads=2)
BATCH = 8


def _model():
    torch.manual_seed(0)
    return kiln.models.create_model("vit", **ARCH).double()


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    x = kiln.models.example_input("vit", BATCH, generator=g, **ARCH).double()
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def _is_dtensor(t):
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _train(model, opt, s0, s1, rank=0, world=1, clip=None):
    """Steps s0..s1-1 of the global batch; this rank feeds its 1/world of it. Returns clip norms."""
    norms = []
    fsdp = any(_is_dtensor(p) for p in model.parameters())
    for s in range(s0, s1):
        x, y = _data(s)
        n = BATCH // world
        F.cross_entropy(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        if world > 1 and not fsdp and not isinstance(opt, ZeroOptimizer):
            all_reduce_gradients(opt)
        if clip is not None:
            norms.append(float(clip_grad_norm_(model.parameters(), clip) if fsdp else ko.clip_grad_norm_(opt, clip)))
        opt.step()
        opt.zero_grad()
    return norms


def _full(model):
    return {k: (v.full_tensor() if _is_dtensor(v) else v).detach().clone() for k, v in model.state_dict().items()}


def _rel_err(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


# -- (a) zero=3 parity -------------------------------------------------------------------------
OPTS = [("AdamW", dict(lr=1e-2, weight_decay=0.1)), ("LAMB", dict(lr=1e-2, weight_decay=0.01)),
        ("LARS", dict(lr=0.1, weight_decay=1e-3)), ("SGD", dict(lr=0.1, momentum=0.9))]


def _parity_worker(rank, world):
    out = {}
    for name, kw in OPTS:
        Opt = getattr(ko, name)
        ref = _model()
        ref_opt = Opt(ref.parameters(), **kw)  # one process, whole batch, arena
        ref_norms = _train(ref, ref_opt, 0, 3, clip=0.5)
        model = apply_fsdp(_model())
        opt = Opt(model.parameters(), contiguous=False, **kw)
        norms = _train(model, opt, 0, 3, rank, world, clip=0.5)
        out[name] = (_rel_err(_full(model), _full(ref)), norms, ref_norms,
                     all(_is_dtensor(v) for st in opt.state.values() for k, v in st.items() if k != "step"))
    try:
        ko.AdamW(apply_fsdp(_model()).parameters())
        out["error"] = None
    except TypeError as e:
        out["error"] = str(e)
    return out


def test_fsdp_parity_kiln_optimizers():
    results = run_distributed(_parity_worker, 2)
    for rank, out in enumerate(results):
        assert out["error"] is not None and "contiguous=False" in out["error"]
        for name, _ in OPTS:
            err, norms, ref_norms, state_is_dtensor = out[name]
            assert err < 1e-6, (rank, name, err)
            assert norms == pytest.approx(ref_norms, rel=1e-9), (name, norms, ref_norms)  # global clip norm
            assert state_is_dtensor, name  # state stays sharded (DCP saves it per shard)


# -- (b) checkpoints that reshard ----------------------------------------------------------------
def _build(kind, world):
    model = _model()
    if kind == "fsdp":
        apply_fsdp(model)
        return model, ko.AdamW(model.parameters(), lr=1e-2, contiguous=False)
    if kind == "zero2":
        return model, ZeroOptimizer(ko.AdamW(model.parameters(), lr=1e-2, shard_multiple=world), stage=2)
    return model, ko.AdamW(model.parameters(), lr=1e-2)


def _ckpt_worker(rank, world, root):
    # save after 2 steps with 2 ranks (ZeRO-2: each rank writes its arena shard's pieces of the
    # state; FSDP2); then load, continue 2 steps, and return the weights: the 1-process
    # checkpoint into FSDP2 and into ZeRO-2 (each rank reads its shard's pieces), and the
    # ZeRO-2 checkpoint into ZeRO-2 (the plain resume)
    for kind in ("zero2", "fsdp"):
        model, opt = _build(kind, world)
        _train(model, opt, 0, 2, rank, world)
        save_sharded(f"{root}/{kind}", model, opt, {"step": 2, "kind": kind})
    out = {}
    for source, kind in (("plain1", "fsdp"), ("plain1", "zero2"), ("zero2", "zero2")):
        model, opt = _build(kind, world)
        extra = load_sharded(f"{root}/{source}", model, opt)
        _train(model, opt, 2, 4, rank, world)
        out[f"{source}->{kind}"] = extra, _full(model)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    ref, ref_opt = _build("plain", 1)
    _train(ref, ref_opt, 0, 2)
    save_sharded(root / "plain1", ref, ref_opt, {"step": 2})  # no process group: one process
    _train(ref, ref_opt, 2, 4)
    results = run_distributed(_ckpt_worker, 2, str(root))
    return root, _full(ref), results


@pytest.mark.parametrize("kind", ["zero2", "fsdp"])
def test_save_2_ranks_load_1_plain(checkpoints, kind):
    root, reference, _ = checkpoints
    d = root / kind
    assert not (root / f"{kind}.tmp").exists()
    assert json.loads((d / "kiln_meta.json").read_text())["world_size"] == 2
    model, opt = _build("plain", 1)
    assert load_sharded(d, model, opt) == {"step": 2, "kind": kind}
    st = opt.state_dict()["state"]
    assert float(st[0]["step"]) == 2.0 and st[0]["exp_avg"].abs().sum() > 0
    _train(model, opt, 2, 4)  # continue: equal to the run that never stopped
    assert _rel_err(_full(model), reference) < 1e-6


def test_load_into_2_ranks_fsdp_and_zero(checkpoints):
    _, reference, results = checkpoints
    for per_rank in results:
        assert sorted(per_rank) == ["plain1->fsdp", "plain1->zero2", "zero2->zero2"]
        for case, (extra, params) in per_rank.items():
            assert extra["step"] == 2, case
            assert _rel_err(params, reference) < 1e-6, case


def test_save_is_atomic_and_replaces(tmp_path):
    model, opt = _build("plain", 1)
    _train(model, opt, 0, 1)
    save_sharded(tmp_path / "ck", model, opt, {"step": 1})
    _train(model, opt, 1, 2)
    save_sharded(tmp_path / "ck", model, opt, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    m2, o2 = _build("plain", 1)
    assert load_sharded(tmp_path / "ck", m2, o2) == {"step": 2}
    assert _rel_err(_full(m2), _full(model)) == 0.0
    assert o2.param_groups[0]["betas"] == (0.9, 0.999)  # tuples come back as tuples from JSON


# -- (c) pipeline stages: a rank holds only some of the parameters --------------------------------
GPT = dict(depth=4, dim=16, heads=2, vocab_size=32, seq_len=8)


def _stage(rank):
    """The whole GPT (rank=None), or what pipeline rank 0 or 1 of 2 holds: the embedding and the
    first half of the blocks, or the rest and the head. What a rank does not hold is nn.Identity
    (as kiln's pipeline cuts stages), so parameter names stay the whole model's. AdamW in two
    groups, as the trainer builds it (no weight decay on 1-D tensors)."""
    torch.manual_seed(0)
    model = kiln.models.create_model("gpt", **GPT).double()
    if rank is not None:
        half = GPT["depth"] // 2
        if rank == 0:
            model.head = nn.Identity()
        else:
            model.embed = nn.Identity()
        for i in range(half, GPT["depth"]) if rank == 0 else range(half):
            model.blocks[i] = nn.Identity()
    ps = list(model.parameters())
    opt = ko.AdamW([{"params": [p for p in ps if p.ndim >= 2]},
                    {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
    return model, opt


def _fake_steps(model, opt, steps):
    """Optimizer steps with gradients that depend only on the parameter's name and the step, so
    that a stage steps its parameters as the whole model does."""
    for s in range(steps):
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + s)
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.5  # as a schedule would have moved it: hyperparameters are saved too


def _named(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    return {k: v.clone() for k, v in model.state_dict().items()}, state


def _same(a, b):
    (ma, sa), (mb, sb) = a, b
    return (ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma) and sa.keys() == sb.keys()
            and all(torch.equal(v, sb[n][k]) for n in sa for k, v in sa[n].items()))


def _pp_worker(rank, world, root):
    model, opt = _stage(rank)
    _fake_steps(model, opt, 2)
    save_sharded(f"{root}/stages", model, opt, {"step": 2})  # each rank writes its own parameters
    saved = _named(model, opt)
    model, opt = _stage(rank)
    assert load_sharded(f"{root}/whole", model, opt) == {"step": 2}  # each reads only its own
    return saved, _named(model, opt), opt.param_groups[0]["lr"]


def test_pipeline_stages_save_their_parameters_and_load_them_from_a_whole_model(tmp_path):
    model, opt = _stage(None)
    _fake_steps(model, opt, 2)
    save_sharded(tmp_path / "whole", model, opt, {"step": 2})
    whole = _named(model, opt)
    results = run_distributed(_pp_worker, 2, str(tmp_path))
    # both ranks' parameters and groups are in the stages' checkpoint, not only rank 0's
    meta = json.loads((tmp_path / "stages" / "kiln_meta.json").read_text())
    assert sorted(meta["state"]) == sorted(whole[1])
    assert [sorted(g["params"]) for g in meta["param_groups"]] == [
        sorted(n for n, p in model.named_parameters() if p.ndim >= 2),
        sorted(n for n, p in model.named_parameters() if p.ndim < 2)]
    # the stages' checkpoint in one process: exactly what the stages held
    union = ({**results[0][0][0], **results[1][0][0]}, {**results[0][0][1], **results[1][0][1]})
    assert union[0].keys() == whole[0].keys()
    model, opt = _stage(None)
    assert load_sharded(tmp_path / "stages", model, opt) == {"step": 2}
    assert _same(_named(model, opt), union)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1e-2] and opt.param_groups[1]["weight_decay"] == 0.0
    # the whole model's checkpoint on each stage: exactly that stage's part of it
    for rank, (saved, loaded, lr) in enumerate(results):
        assert loaded[0].keys() == saved[0].keys() and 0 < len(saved[0]) < len(whole[0]), rank
        assert _same(loaded, ({k: whole[0][k] for k in saved[0]}, {k: whole[1][k] for k in saved[1]})), rank
        assert lr == 0.5


def test_metadata_unpickler_refuses_code(tmp_path):
    from kiln.parallel._checkpoint import _MetadataUnpickler

    import io
    import os

    payload = pickle.dumps(os.system)
    with pytest.raises(pickle.UnpicklingError):
        _MetadataUnpickler(io.BytesIO(payload)).load()
