"""kiln.parallel._pp: pipeline parallelism for GPT and BERT on torch.distributed.pipelining (gloo, CPU).

Each distributed test spawns its processes once and runs every (model, schedule) case
inside them. A case trains 3 steps of kiln.optim.AdamW over each rank's stages and reports,
by whole-model FQN, which parameters each stage holds, the gradients of the last step and the
parameters after it; the test compares them with one process training the whole model on
the same global batch (1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import kiln.optim as ko
from kiln.models import create_model
from kiln.parallel._pp import (_torch_order, build_pipeline, check_pipeline, cut_stage, schedule_bubble, stage_ranges,
                              stage_ranks, unit_costs)
from kiln.launch.testing import run_distributed
from kiln.parallel._zero import all_reduce_gradients

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

STEPS, BATCH, MICRO, SEQ, DEPTH = 3, 8, 4, 16, 4
EVAL_BATCH = 6  # not a multiple of MICRO: forward() picks 3 micro-batches
TOL = 1e-5


def _model(name: str):
    torch.manual_seed(0)
    return create_model(name, dim=32, depth=DEPTH, heads=4, seq_len=SEQ, dropout=0.0)


def _batch(name: str, step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(256, (size, SEQ), generator=g)
    targets = torch.randint(256, (size, SEQ), generator=g)
    if name == "bert":  # mlm: score 4 positions per sequence (the same count everywhere)
        targets[:, torch.arange(SEQ) % 4 != 0] = -100
    return ids, targets


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (b, T, V), (b, T)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _optimizer(params) -> ko.AdamW:
    return ko.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(name: str, dp: int) -> dict:
    """One process, the whole global batch per step, computed as the pipeline computes it: each
    dp rank's share in MICRO micro-batches, each loss divided by MICRO, then the dp average."""
    model = _model(name)
    opt = _optimizer(model.parameters())
    losses, grads = [], []
    share = BATCH // dp
    for step in range(STEPS):
        ids, targets = _batch(name, step)
        total, loss = None, 0.0
        for r in range(dp):
            model.zero_grad(set_to_none=False)
            mine = slice(r * share, (r + 1) * share)
            for x, y in zip(ids[mine].chunk(MICRO), targets[mine].chunk(MICRO)):
                micro = _loss(model(x), y) / MICRO
                micro.backward()
                loss += micro.item() / dp
            mine = [p.grad.clone() for p in model.parameters()]
            total = mine if total is None else [a + b for a, b in zip(total, mine)]
        with torch.no_grad():
            for p, g in zip(model.parameters(), total):
                p.grad.copy_(g / dp)
        losses.append(loss)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(_batch(name, 99, EVAL_BATCH)[0])
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "logits": logits}


def _whole_batch(name: str) -> dict:
    """The plain definition: the loss is the mean over the unsplit global batch."""
    model = _model(name)
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(name, step)
        loss = _loss(model(ids), targets)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def _train_case(name: str, schedule: str, pp: int, dp: int, timing: bool) -> dict:
    if dp > 1:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        dp_rank = mesh.get_local_rank("dp")
    else:
        mesh, dp_rank = None, 0
    pipe = build_pipeline(_model(name), mesh, schedule=schedule, microbatches=MICRO, loss_fn=_loss, timing=timing)
    opt = _optimizer(pipe.parameters())
    losses, grads = [], []
    share = BATCH // dp
    for step in range(STEPS):
        ids, targets = _batch(name, step)
        mine = slice(dp_rank * share, (dp_rank + 1) * share)
        # inputs only where the first stage is, targets only where the last is
        loss = pipe.step(ids[mine] if pipe.is_first else None, targets[mine] if pipe.is_last else None)
        assert loss.dim() == 0 and not loss.requires_grad
        if pipe.dp_group is not None:
            all_reduce_gradients(opt, pipe.dp_group)
            dist.all_reduce(loss, group=pipe.dp_group)  # for the comparison: the global batch's mean
            loss /= dp
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
        opt.zero_grad()
    errors = []
    if timing:  # once per spawn: a bad call raises the same error on every rank instead of hanging
        for args in ((None, targets), (ids[:6], targets[:6])):
            with pytest.raises(ValueError) as err:
                pipe.step(*args)
            errors.append(str(err.value))
    logits = pipe.forward(_batch(name, 99, EVAL_BATCH)[0] if pipe.is_first else None)
    shared = pipe.share_from_last(None if logits is None else logits.sum().item())
    return {"name": name, "schedule": schedule, "stages": dict(zip(pipe.stage_indices,
                                                                   [sorted(n for n, _ in s.named_parameters())
                                                                    for s in pipe.stages])),
            "losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "logits": logits, "shared": shared, "timing": pipe.last_step_timing, "errors": errors,
            "training": [s.training for s in pipe.stages], "is_first": pipe.is_first, "is_last": pipe.is_last}


def _worker(rank: int, world: int, cases: list[tuple[str, str]], pp: int, dp: int) -> list[dict]:
    return [_train_case(name, schedule, pp, dp, timing=(i == 0)) for i, (name, schedule) in enumerate(cases)]


def _expected_stage_fqns(name: str, num_stages: int) -> list[list[str]]:
    names = [n for n, _ in _model(name).named_parameters()]
    ranges = stage_ranges(DEPTH, num_stages)
    out = []
    for s, r in enumerate(ranges):
        keep = [f"blocks.{i}." for i in r] + (["embed."] if s == 0 else []) + (["head."] if s == num_stages - 1 else [])
        out.append(sorted(n for n in names if n.startswith(tuple(keep))))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# The gradient of the attention's key bias is exactly zero (adding q.b to every score of a row
# leaves the softmax unchanged); what backward computes is round-off (~1e-11), which no
# relative comparison can hold, and which AdamW turns into updates of ~lr * g / (|g| + eps).
# It is checked to be round-off instead, and its value (which cannot change any output) is skipped.
_NULL = "attn.wk.bias"


def _gather(per_rank: list[dict], key: str, pp: int, dp: int, dp_rank: int, step: int | None = None) -> dict:
    gathered: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        part = per_rank[pp_rank * dp + dp_rank][key]
        part = part if step is None else part[step]
        assert not set(part) & set(gathered)  # each parameter lives on exactly one pp rank
        gathered.update(part)
    return gathered


def _compare(got: dict, ref: dict, what: tuple, tol: float = TOL) -> None:
    assert sorted(got) == sorted(ref), what
    worst = max((_rel(got[n], ref[n]), n) for n in ref if _NULL not in n)
    assert worst[0] < tol, (*what, worst)


def _check(results: list[list[dict]], refs: dict, pp: int, dp: int) -> None:
    for case in range(len(results[0])):
        per_rank = [r[case] for r in results]
        name, schedule = per_rank[0]["name"], per_rank[0]["schedule"]
        ref, whole = refs[name, dp], refs[name, "whole"]
        rank_of = stage_ranks(pp, schedule)
        num_stages = len(rank_of)
        # the cut: stage s on pp rank s % pp (looped), or ranks r and 2 pp - 1 - r on rank r (V),
        # holding exactly its blocks (+ embed first, + head last)
        expected = _expected_stage_fqns(name, num_stages)
        for rank, res in enumerate(per_rank):
            pp_rank = rank // dp  # mesh (pp, dp): dp neighbours are consecutive ranks
            placed = {"interleaved-1f1b": list(range(pp_rank, num_stages, pp)),
                      "interleaved-zb": list(range(pp_rank, num_stages, pp)),
                      "zbv": [pp_rank, 2 * pp - 1 - pp_rank], "dualpipev": [pp_rank, 2 * pp - 1 - pp_rank]}
            assert sorted(res["stages"]) == placed.get(schedule, [pp_rank])
            for s, fqns in res["stages"].items():
                assert fqns == expected[s], (name, schedule, s)
            last = 0 if schedule in ("zbv", "dualpipev") else pp - 1  # the V comes back to rank 0
            assert res["is_first"] == (pp_rank == 0) and res["is_last"] == (pp_rank == last)
        # every pp rank returns the batch's mean loss: the reference's, and the unsplit batch's
        for res in per_rank:
            assert res["losses"] == pytest.approx(ref["losses"], rel=TOL), (name, schedule)
            assert res["losses"] == pytest.approx(whole["losses"], rel=TOL), (name, schedule)
        for dp_rank in range(dp):
            what = (name, schedule, f"dp rank {dp_rank}")
            # the gradients are those of the mean loss over the unsplit batch (first step: the
            # later ones start from weights that micro-batch round-off, amplified by Adam, moved)
            first = _gather(per_rank, "grads", pp, dp, dp_rank, 0)
            _compare(first, whole["grads"], (*what, "grads vs unsplit batch"))
            for step in range(STEPS):
                grads = _gather(per_rank, "grads", pp, dp, dp_rank, step)
                _compare(grads, ref["grads"][step], (*what, f"grads step {step}"))
                scale = max(g.norm() for g in grads.values())
                assert all(g.norm() < 1e-6 * scale for n, g in grads.items() if _NULL in n)
            _compare(_gather(per_rank, "params", pp, dp, dp_rank), ref["params"], (*what, "params"))
        # forward(): logits (eval mode, no grad) on the last stage only, modes restored after
        for rank, res in enumerate(per_rank):
            assert res["training"] == [True] * len(res["stages"])
            if res["is_last"]:
                assert res["logits"].shape == (EVAL_BATCH, SEQ, 256) and not res["logits"].requires_grad
                assert _rel(res["logits"], ref["logits"]) < TOL
            else:
                assert res["logits"] is None
            assert res["shared"] == pytest.approx(ref["logits"].sum().item(), rel=1e-4)
        timing = per_rank[0]["timing"]
        assert timing["wall_s"] > 0
        if case == 0:  # built with timing=True
            assert 0 < timing["compute_s"] <= timing["wall_s"] and 0 <= timing["bubble"] < 1
            for res in per_rank:
                assert "first stage (pp rank 0) got no inputs" in res["errors"][0]
                assert f"batch of 6 does not split into {MICRO}" in res["errors"][1]


@pytest.fixture(scope="module")
def refs() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        out = {(name, dp): _reference(name, dp) for name in ("gpt", "bert") for dp in (1, 2)}
        out.update({(name, "whole"): _whole_batch(name) for name in ("gpt", "bert")})
    finally:
        torch.set_num_threads(threads)
    return out


def test_pp2_every_schedule_matches_one_process(refs):
    cases = [("gpt", "gpipe"), ("gpt", "1f1b"), ("gpt", "interleaved-1f1b"), ("bert", "1f1b"),
             ("bert", "interleaved-1f1b")]
    _check(run_distributed(_worker, 2, cases, 2, 1), refs, pp=2, dp=1)


def test_dp2_x_pp2_matches_one_process(refs):
    cases = [("gpt", "1f1b"), ("bert", "gpipe")]
    _check(run_distributed(_worker, 4, cases, 2, 2), refs, pp=2, dp=2)


# -- no processes -----------------------------------------------------------------------------
def test_stage_ranges_even_and_extras_to_the_middle():
    assert stage_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert [len(r) for r in stage_ranges(6, 4)] == [1, 2, 2, 1]
    assert [len(r) for r in stage_ranges(5, 4)] == [1, 2, 1, 1]
    assert [len(r) for r in stage_ranges(12, 5)] == [2, 3, 3, 2, 2]
    assert [len(r) for r in stage_ranges(3, 2)] == [2, 1]  # no middle: the first stage, not the head's
    assert [len(r) for r in stage_ranges(5, 3)] == [2, 2, 1]
    assert stage_ranges(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    for depth in range(1, 13):
        for n in range(1, depth + 1):
            ranges = stage_ranges(depth, n)
            assert [i for r in ranges for i in r] == list(range(depth))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("sizes, words", [([2, 1], ["sums to 3", "depth=4"]), ([4], ["1 entries", "2 pipeline stages"]),
                                          ([4, 0], ["at least one block"]), ([2, 2, 0], ["3 entries"])])
def test_stage_ranges_rejects_bad_sizes(sizes, words):
    with pytest.raises(ValueError) as err:
        stage_ranges(4, 2, sizes)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("args, words", [
    ((4, 2, "1fib", 4, 8), ["'1fib'", "did you mean '1f1b'"]),
    ((4, 2, "zigzag", 4, 8), ["'zigzag'", "gpipe, 1f1b, interleaved-1f1b"]),
    ((1, 2, "gpipe", 4, 8), ["depth=1", "pp=2"]),
    ((3, 2, "interleaved-1f1b", 4, 8), ["depth=3", "pp=2 x virtual_stages=2 = 4", "schedule 1f1b"]),
    ((4, 2, "gpipe", 3, 8), ["(8)", "microbatches=3", "multiple of 3"]),
    ((4, 4, "1f1b", 2, 8), ["microbatches=2 < pp=4", ">= 4", "gpipe"]),
    ((8, 2, "interleaved-1f1b", 1, 8), ["microbatches=1 < pp=2"]),
    ((8, 2, "interleaved-1f1b", 5, 10), ["2 rounds", "microbatches=5", "multiple of pp=2"]),
    ((4, 2, "gpipe", 2, 8, [3, 3]), ["sums to 6", "depth=4"]),
    # the zero-bubble schedules: the V needs 2 x pp blocks, DualPipeV a micro-batch per stage,
    # the looped one the rounds of the interleaved one
    ((3, 2, "zbv", 4, 8), ["depth=3", "2 x pp=2 = 4 (two a rank, in a V)", "schedule 1f1b"]),
    ((8, 2, "dualpipev", 2, 8), ["microbatches=2 < 2 x pp = 4 stages", ">= 4", "schedule zbv"]),
    ((8, 2, "interleaved-zb", 1, 8), ["microbatches=1 < pp=2"]),
    ((8, 2, "interleaved-zb", 5, 10), ["ScheduleInterleavedZeroBubble", "2 rounds", "multiple of pp=2"]),
    ((4, 2, "gpipe", 0, 8), ["microbatches=0"]),
])
def test_check_pipeline_errors_name_numbers_and_fix(args, words):
    with pytest.raises(ValueError) as err:
        check_pipeline(*args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_check_pipeline_accepts_valid_configs():
    check_pipeline(4, 2, "gpipe", 1, 8)  # GPipe: any micro-batch count
    check_pipeline(4, 2, "1f1b", 4, 8)
    check_pipeline(4, 2, "interleaved-1f1b", 4, 8)
    check_pipeline(8, 4, "interleaved-1f1b", 6, 12)  # torch's flexible rounds: 1 round of 6
    check_pipeline(4, 2, "GPipe", 2, 8, [3, 1])
    check_pipeline(1, 1, "1f1b", 1, 3)  # pp=1: no pipeline
    check_pipeline(4, 2, "zbv", 1, 8)  # ZB-V: torch pads its order, any micro-batch count runs
    check_pipeline(4, 2, "dualpipev", 4, 8)
    check_pipeline(8, 4, "interleaved-zb", 4, 8)


@pytest.mark.parametrize("schedule, pp, m", [(s, pp, m) for s in ("interleaved-zb", "zbv", "dualpipev")
                                              for pp, m in ((2, 4), (4, 8))])
def test_every_checked_schedule_is_one_torch_builds(schedule, pp, m):
    """What check_pipeline accepts, torch's class accepts and orders without deadlock (the
    order computed on every rank, as its constructor does), and what it refuses torch refuses."""
    check_pipeline(2 * pp, pp, schedule, m, m)
    assert len(schedule_bubble(schedule, pp, m)) == pp
    if schedule == "dualpipev":
        with pytest.raises(ValueError, match="at least one micro-batch per pipeline stage"):
            check_pipeline(2 * pp, pp, schedule, m - 1, m - 1)
        with pytest.raises(ValueError, match="at least as many microbatches as stages"):
            _torch_order(schedule, pp, m - 1)


def test_stage_ranks_place_the_v_and_the_loop():
    assert stage_ranks(2, "1f1b") == [0, 1]
    assert stage_ranks(2, "interleaved-zb") == [0, 1, 0, 1]
    assert stage_ranks(4, "zbv") == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks(4, "dualpipev") == stage_ranks(4, "zbv")
    # torch's own mapping for its V schedules
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping
    assert [generate_stage_to_rank_mapping(4, 8, style="v")[s] for s in range(8)] == stage_ranks(4, "zbv")


def test_schedule_bubble_textbook_numbers():
    """The unit-cost model reproduces the textbook bubbles: fill-drain's (p - 1) / (m + p - 1) for
    GPipe and 1F1B, and lower ones for the schedules that fill it with weight work."""
    for pp, m in ((2, 4), (4, 8)):
        fill_drain = (pp - 1) / (m + pp - 1)
        assert max(schedule_bubble("gpipe", pp, m)) == pytest.approx(fill_drain)
        assert max(schedule_bubble("1f1b", pp, m)) == pytest.approx(fill_drain)
        for zb in ("interleaved-zb", "zbv", "dualpipev"):
            assert sum(schedule_bubble(zb, pp, m)) / pp < fill_drain, (zb, pp, m)
    # interleaved 1F1B with v = 2: (p - 1) / (v m + p - 1); the zero-bubble ones at pp=2, m=4:
    # 24 units of work a rank (2 stages x 4 micro-batches x F, I, W) in 25
    assert schedule_bubble("interleaved-1f1b", 2, 4) == pytest.approx([1 / 9, 1 / 9])
    for zb in ("interleaved-zb", "zbv", "dualpipev"):
        assert schedule_bubble(zb, 2, 4) == pytest.approx([1 / 25, 1 / 25]), zb


def test_schedule_bubble_with_given_costs():
    """Each (stage, pass) at its own cost: 1F1B at pp=2, m=2 with the second stage twice as slow.
    Rank 1 runs F0 [1, 3], B0 [3, 7], F1 [7, 9], B1 [9, 13]; rank 0 F0, F1 [0, 2], then waits for
    each input gradient: B0 [7, 9], B1 [13, 15]. Busy 6 and 12 of 15."""
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 2.0, (1, "B"): 4.0}
    assert schedule_bubble("1f1b", 2, 2, costs=costs) == pytest.approx([9 / 15, 3 / 15])
    # the same costs scaled: the same shares; the unit costs given explicitly: the default
    assert schedule_bubble("1f1b", 2, 2, costs={k: 3 * c for k, c in costs.items()}) == pytest.approx([0.6, 0.2])
    for zb in ("interleaved-zb", "zbv"):
        assert schedule_bubble(zb, 2, 8, costs=unit_costs(zb, 2)) == schedule_bubble(zb, 2, 8)
    # torch's first stage: no input gradient to hand on, its whole backward in the weight pass
    assert unit_costs("zbv", 2)[(0, "I")] == 0 and unit_costs("zbv", 2)[(0, "W")] == 2
    assert unit_costs("zbv", 2)[(3, "I")] == unit_costs("zbv", 2)[(3, "W")] == 1
    # a split backward that costs more than a whole one (torch's I + W on CPU: about x1.25), on
    # every stage but the first: interleaved-zb's rank 0 (stages 0 and 2) then waits on rank 1
    # (stages 1 and 3, both split), while its unit-cost bubble is the same on both ranks
    dear = {k: (1.25 * c if k[1] in "IW" and k[0] != 0 else c) for k, c in unit_costs("interleaved-zb", 2).items()}
    idle = schedule_bubble("interleaved-zb", 2, 8, costs=dear)
    assert idle[0] > 2 * idle[1] and idle[0] > schedule_bubble("interleaved-zb", 2, 8)[0]


def test_fsdp2_with_a_split_backward_is_refused_before_building():
    from kiln.config import ConfigError, validate
    from kiln.parallel import check_parallel_config

    base = {"model": {"name": "gpt", "depth": 4}, "train": {"max_steps": 1}, "data": {"name": "synthetic_tokens"}}
    check_parallel_config(validate({**base, "parallel": {"pp": 2, "zero": 2, "pp_schedule": "zbv"}}))
    with pytest.raises(ConfigError, match=r"parallel.pp_schedule=zbv computes the weight gradients .* "
                                          r"Use parallel.zero=1 or 2 .* 1f1b, interleaved-1f1b or gpipe"):
        check_parallel_config(validate({**base, "parallel": {"pp": 2, "zero": 3, "pp_schedule": "zbv"}}))
    with pytest.raises(ConfigError, match=r"microbatches=2 < 2 x pp = 4 stages"):
        check_parallel_config(validate({**base, "parallel": {"pp": 2, "microbatches": 2,
                                                             "pp_schedule": "dualpipev"}}))


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_cut_stage_keeps_fqns_and_only_its_parts(name):
    model = _model(name)
    ranges = stage_ranges(DEPTH, 3)  # [1, 2, 1] blocks
    whole = dict(model.named_parameters())
    expected = _expected_stage_fqns(name, 3)
    ids = _batch(name, 0)[0]
    x = ids
    for s in range(3):
        stage = cut_stage(model, ranges, s)
        params = dict(stage.named_parameters())
        assert sorted(params) == expected[s]
        for n, p in params.items():  # a copy: same values, own storage
            assert torch.equal(p, whole[n]) and p.data_ptr() != whole[n].data_ptr()
        assert isinstance(stage.embed, torch.nn.Identity) == (s != 0)
        assert isinstance(stage.head, torch.nn.Identity) == (s != 2)
        x = stage(x)
    assert torch.equal(x, model(ids))  # the stages compose to the whole model
    assert dict(model.named_parameters()).keys() == whole.keys()  # model untouched


def test_tied_embeddings_across_stages_is_refused():
    torch.manual_seed(0)
    model = create_model("gpt", dim=32, depth=DEPTH, heads=4, seq_len=SEQ, tie_embeddings=True)
    with pytest.raises(ValueError, match="model.tie_embeddings=false"):
        cut_stage(model, stage_ranges(DEPTH, 2), 0)
    one = cut_stage(model, stage_ranges(DEPTH, 1), 0)  # one stage: the tie is kept
    assert one.head.out.weight is one.embed.tok.weight


def test_models_that_are_not_embed_blocks_head_are_refused():
    with pytest.raises(TypeError, match="head\\(blocks\\(embed\\(x\\)\\)\\).*ViT"):
        cut_stage(create_model("vit", depth=2), stage_ranges(2, 2), 0)


def test_pp2_zero_bubble_schedules_match_one_process(refs):
    cases = [("gpt", "interleaved-zb"), ("gpt", "zbv"), ("gpt", "dualpipev"), ("bert", "zbv")]
    _check(run_distributed(_worker, 2, cases, 2, 1), refs, pp=2, dp=1)
