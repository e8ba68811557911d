"""3-D layouts through :func:`kiln.parallel.parallelize`, the trainer's one call: tp x pp, and
ZeRO / FSDP2 over dp combined with pp and tp, against one process on the same global batch.

(tp alone and dp x tp: tests/test_parallel_tp.py; pp alone and dp x pp with every schedule:
tests/test_parallel_pp.py; here the combinations that only parallelize() makes.)

The reference splits each batch into the same micro-batches as the pipeline (loss / M each,
gradients accumulated), so both sides add the same per-micro-batch gradients; Adam's eps is
1e-4 because the key projection's bias has a true gradient of exactly zero (softmax ignores a
shift common to all keys), and with a tiny eps Adam would turn its ~1e-9 round-off into full
steps that no two summation orders agree on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.optim
from kiln.models import create_model
from kiln.parallel import Layout, ZeroOptimizer, parallelize
from kiln.launch.testing import run_distributed

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

STEPS, BATCH, SEQ, M = 3, 8, 16, 4
MODEL = dict(dim=32, depth=4, heads=4, seq_len=SEQ)
RTOL = 1e-5  # losses and norms; gradients: max |difference| / max |reference| per tensor
# Parameters after 3 Adam steps of lr 1e-2: round-off of the different summation orders moves
# them by ~2e-7 (Adam divides each gradient by its own scale); 1e-6 is 1e-4 of one step.
PARAM_ATOL = 1e-6
# The key bias's true gradient is 0: both sides hold round-off only, compared to this bound.
NOISE = 1e-6

# (model, dp, tp, pp, zero, schedule): every one runs in the same 4-process spawn
CASES = [
    ("gpt", 1, 2, 2, 0, "1f1b"),
    ("bert", 1, 2, 2, 0, "interleaved-1f1b"),
    ("gpt", 2, 1, 2, 2, "gpipe"),  # ZeRO-2 over dp, on each stage's arena
    ("bert", 2, 2, 1, 3, "1f1b"),  # FSDP2 over dp on top of tensor parallel
    ("gpt", 2, 1, 2, 3, "1f1b"),  # FSDP2 over dp on each pipeline stage
    # the zero-bubble schedules: tp x pp, dp x pp (replicated, and ZeRO-2 over dp), pp=4 alone
    ("gpt", 1, 2, 2, 0, "zbv"),
    ("bert", 1, 2, 2, 0, "interleaved-zb"),
    ("gpt", 2, 1, 2, 2, "dualpipev"),
    ("bert", 2, 1, 2, 0, "zbv"),
    ("gpt", 1, 1, 4, 0, "zbv"),  # 8 stages: 2 x pp, in a V
    ("bert", 1, 1, 4, 0, "interleaved-zb"),
    ("gpt", 1, 1, 4, 0, "dualpipev"),  # a micro-batch a stage: 8 of one sample
]
V_SCHEDULES = ("zbv", "dualpipev")  # the last stage comes back to pp rank 0


def _model_kw(pp: int) -> dict:
    return dict(MODEL, depth=8) if pp > 2 else MODEL  # a block for each of the 2 x pp stages


def _micro(pp: int, schedule: str) -> int:
    return max(M, 2 * pp) if schedule == "dualpipev" else M  # DualPipeV: at least a micro-batch a stage


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(255, (BATCH, SEQ), generator=g), torch.randint(255, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def _optimizer(params, contiguous: bool) -> torch.optim.Optimizer:
    return kiln.optim.AdamW(params, lr=1e-2, eps=1e-4, contiguous=contiguous)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _run_case(rank: int, name: str, dp: int, tp: int, pp: int, zero: int, schedule: str) -> dict:
    torch.manual_seed(0)
    layout = Layout(dp, tp, pp)
    m = _micro(pp, schedule)
    par = parallelize(create_model(name, **_model_kw(pp)), layout, zero=zero, pp_schedule=schedule, microbatches=m,
                      loss_fn=_loss)
    opt = par.data_parallel(_optimizer(par.model.parameters(), par.arena))  # ZeRO-1/2: the wrapper
    me = layout.coords(rank)
    losses, grads, norms = [], [], []
    for inputs, targets in _batches():
        x, y = inputs.chunk(dp)[me["dp"]], targets.chunk(dp)[me["dp"]]
        if par.pipeline is not None:
            loss = par.pipeline.step(x, y)
        else:
            with par.loss_context():
                loss = 0.0
                for xm, ym in zip(x.chunk(m), y.chunk(m)):  # the reference's micro-batches
                    part = _loss(par.model(xm), ym) / m
                    part.backward()
                    loss = loss + par.value(part)
        par.reduce_gradients()
        norms.append(float(par.clip(opt, 1.0)))  # clipping active: the first norm is ~1.4
        if not isinstance(opt, ZeroOptimizer):  # ZeRO-2 keeps only this rank's gradient shard
            grads.append({n: _full(p.grad) for n, p in par.model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = {n: _full(p) for n, p in par.model.named_parameters()}
    return {"coords": me, "losses": losses, "grads": grads, "norms": norms, "params": params}


def _worker(rank: int, world: int) -> list[dict]:
    return [_run_case(rank, *case) for case in CASES]


def _reference(name: str, dp: int, pp: int, m: int = M) -> dict:
    torch.manual_seed(0)
    model = create_model(name, **_model_kw(pp))
    opt = _optimizer(model.parameters(), True)
    losses, grads, norms = [], [], []
    for inputs, targets in _batches():
        per_rank = []
        # dp ranks each average over their half, then the halves are averaged: per micro-batch
        # loss / (m * dp) over dp * m micro-batches of BATCH / (dp * m)
        for x, y in zip(inputs.chunk(dp), targets.chunk(dp)):
            total = 0.0
            for xm, ym in zip(x.chunk(m), y.chunk(m)):
                part = _loss(model(xm), ym) / (m * dp)
                part.backward()
                total += part.item() * dp
            per_rank.append(total)
        norms.append(float(kiln.optim.clip_grad_norm_(opt, 1.0)))
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(per_rank)
    return {"losses": losses, "grads": grads, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def results() -> list[list[dict]]:
    return run_distributed(_worker, 4, timeout_s=300)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_layout_trains_like_one_process(results, case):
    name, dp, tp, pp, zero, schedule = CASES[case]
    ref = _reference(name, dp, pp, _micro(pp, schedule))
    outs = [r[case] for r in results]
    merged_params: dict[str, torch.Tensor] = {}
    merged_grads: list[dict[str, torch.Tensor]] = [{} for _ in range(STEPS)]
    for out in outs:
        for step in range(STEPS):
            # the loss of this rank's data-parallel replica, on every tp and pp rank of it
            assert out["losses"][step] == pytest.approx(ref["losses"][step][out["coords"]["dp"]], rel=RTOL)
        assert out["norms"] == pytest.approx(ref["norms"], rel=RTOL)  # the global norm, same on all ranks
        merged_params.update(out["params"])
        for step, g in enumerate(out["grads"]):
            merged_grads[step].update(g)
    # every parameter lives on some rank, under the whole model's name, with the reference's value
    assert set(merged_params) == set(ref["params"])
    for fqn, value in ref["params"].items():
        torch.testing.assert_close(merged_params[fqn], value, rtol=0, atol=PARAM_ATOL, msg=fqn)
    if zero not in (1, 2):
        for step in range(STEPS):
            assert set(merged_grads[step]) == set(ref["grads"][step])
            for fqn, value in ref["grads"][step].items():
                got = merged_grads[step][fqn]
                if fqn.endswith("attn.wk.bias"):
                    assert got.abs().max() < NOISE and value.abs().max() < NOISE, fqn
                    continue
                err = ((got - value).abs().max() / value.abs().max()).item()
                # 8 blocks over 8 stages: a third step's gradients that Adam-moved weights feed
                # differ by up to ~1.2e-5 (the pipeline's summation order); held to 1e-4 there
                assert err < (RTOL if pp <= 2 else 1e-4), (f"step {step + 1}", fqn, err)
    if pp > 1:
        # each pipeline rank holds only its stages' parameters
        by_pp = {}
        for out in outs:
            by_pp.setdefault(out["coords"]["pp"], set()).update(out["params"])
        assert not by_pp[0] & by_pp[1]
        head_on = 0 if schedule in V_SCHEDULES else pp - 1
        for r, held in by_pp.items():
            assert ("embed.tok.weight" in held) == (r == 0), r
            assert any(k.startswith("head.") for k in held) == (r == head_on), r
