"""Parallel plans live beside their models: ``kiln.parallel`` applies a family's registered
:class:`~kiln.models.ParallelPlan` and knows no model's module names.

- The source of ``kiln/parallel/*.py`` names none of kiln's models' modules or options (read
  with ``ast``: string constants that are module paths, and attribute names).
- Every registered plan fits its model (each pattern names a module, the pipeline plan covers
  every parameter), and GPT/BERT's plan splits exactly Megatron's parameters.
- A toy family whose modules have other names (``stem.lookup``, ``layers.i.up/down``,
  ``final.proj``), registered with a plan and nothing else, gets tensor and pipeline
  parallelism: config checks accept it, ``kiln plan``'s sharded set comes from its plan, and in
  2 gloo processes tp=2 and pp=2 compute its one-process loss and gradients (which an ignored
  plan would not: tp=2 without a plan is refused, and the local shapes are checked).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln.models
from kiln.models import ParallelPlan, PipelinePlan, TensorParallelPlan, create_model
from kiln.models import _registry
from kiln.models._parallel_plan import check_tp_divides
from kiln.launch.testing import run_distributed

# The module and option names of kiln's models (transformer.py, gpt.py, bert.py, vit.py, mlp.py,
# encoder.py) that a parallel layer hard-coding a family would spell: "blocks" included (FSDP asks
# kiln.models.repeated_blocks); generic words that name no module ("norm" as tensor.norm(), "out")
# are left out.
MODEL_NAMES = {"embed", "tok", "pos", "blocks", "head", "attn", "mlp", "wq", "wk", "wv", "wo", "fc1", "fc2",
               "norm1", "norm2", "dense", "transform_norm", "patch", "cls_token", "tie_embeddings", "heads",
               "mlp_ratio", "vocab_size", "seq_len"}
_PATH = re.compile(r"\.?[A-Za-z_*][\w*]*(\.[\w*]+)*\.?")  # "embed", "blocks.", ".attn.wq", "head.*"


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _model_names_in(source: str) -> list[str]:
    tree = ast.parse(source)
    skip = _docstrings(tree)  # prose for the reader, which may show GPT as the example
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in MODEL_NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if _PATH.fullmatch(node.value) and MODEL_NAMES & set(node.value.strip(".").split(".")):
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_scan_finds_what_the_old_parallel_layer_spelled():
    old = '''
blocks = getattr(model, "blocks", None)
stray = [n for n in names if not n.startswith(("embed.", "blocks.", "head."))]
plan[f"{b}.attn.wq"] = ColwiseParallel()
tied = model.head.out.weight is model.embed.tok.weight
if model_cfg.tie_embeddings: pass
'''
    found = "\n".join(_model_names_in(old))
    for name in ("'blocks'", "'embed.'", "'.attn.wq'", ".head", ".embed", ".tok", ".tie_embeddings"):
        assert name in found, name
    assert _model_names_in('x.norm(); s = "parallel.tp"; """a docstring about embed.tok"""') == []


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].joinpath("kiln", "parallel").glob("*.py")),
                         ids=lambda p: p.name)
def test_parallel_package_names_no_model_module(path):
    assert _model_names_in(path.read_text()) == [], f"{path.name} spells a model's module names"


# -- the registered plans --------------------------------------------------------------------------
@pytest.mark.parametrize("name", kiln.models.models_with("tp"))
def test_every_tensor_parallel_pattern_names_a_module(name):
    from kiln.parallel._tp import _matches

    with torch.device("meta"):
        model = create_model(name)
    paths = [p for p, _ in model.named_modules()]
    for pattern in kiln.models.model_plan(name).tp.styles:
        assert any(_matches(pattern, p) for p in paths), f"{name}: {pattern} names no module"


@pytest.mark.parametrize("name", kiln.models.models_with("pp"))
def test_every_pipeline_plan_fits_its_model(name):
    from kiln.parallel._pp import stage_of_parameters, stage_ranges

    with torch.device("meta"):
        model = create_model(name)
    plan = kiln.models.model_plan(name).pp
    depth = len(kiln.models.repeated_blocks(model))
    assert depth == plan.depth(model_config_of(name))
    owner = stage_of_parameters(model, stage_ranges(depth, 2))
    assert set(owner.values()) == {0, 1}
    assert kiln.models.repeated_blocks(model) is model.get_submodule(plan.repeated)


def model_config_of(name):
    return kiln.models.model_config_class(name)()


@pytest.mark.parametrize("name", ["gpt", "bert"])
@pytest.mark.parametrize("sp", [False, True])
def test_language_model_plan_splits_megatrons_parameters(name, sp):
    from kiln.parallel._tp import tp_sharded_names

    megatron = re.compile(r"blocks\.\d+\.(attn\.w[qkv]\.(weight|bias)|attn\.wo\.weight|mlp\.fc1\.(weight|bias)"
                          r"|mlp\.fc2\.weight)|embed\.tok\.weight|head\.out\.(weight|bias)")
    with torch.device("meta"):
        model = create_model(name, depth=3)
    expected = {n for n, _ in model.named_parameters() if megatron.fullmatch(n)}
    assert tp_sharded_names(model, 2, sequence_parallel=sp) == expected
    assert tp_sharded_names(create_model("vit", depth=1), 2) == set()  # no plan: nothing splits


def test_plan_rejects_unknown_style_names():
    with pytest.raises(ValueError, match="'colwsie' is not a named style; did you mean 'colwise'"):
        TensorParallelPlan(styles={"layers.*.up": "colwsie"})
    with pytest.raises(TypeError, match="ParallelPlan"):
        _registry.register_model("_bad_plan", kiln.models.model_config_class("mlp"), plan={"tp": {}})


# -- a family the parallel layer has never heard of --------------------------------------------------
@dataclasses.dataclass
class ToyConfig:
    vocab: int = 48  # V
    width: int = 8  # C
    hidden: int = 32  # F
    layers: int = 4
    seq_len: int = 8
    tie: bool = False

    @property
    def num_classes(self) -> int:
        return self.vocab

    def example_input(self, batch_size, generator=None):
        return torch.randint(self.vocab, (batch_size, self.seq_len), generator=generator)


class _Stem(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.lookup = nn.Embedding(cfg.vocab, cfg.width)

    def forward(self, ids):  # (B, T) -> (B, T, C)
        return self.lookup(ids)


class _Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.width)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        return x + self.down(F.gelu(self.up(self.ln(x))))


class _Final(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, x):  # (B, T, C) -> (B, T, V)
        return self.proj(x)


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.stem = _Stem(cfg)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.final = _Final(cfg)
        if cfg.tie:
            self.final.proj.weight = self.stem.lookup.weight

    def forward(self, ids):
        x = self.stem(ids)
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


def _check_toy(cfg, tp, sequence_parallel):
    check_tp_divides(tp, {"model.hidden": cfg.hidden, "model.vocab": cfg.vocab})


TOY_PLAN = ParallelPlan(
    tp=TensorParallelPlan(styles={"stem.lookup": "vocab_embedding", "layers.*.up": "colwise",
                                  "layers.*.down": "rowwise", "final.proj": "vocab_head"}, check=_check_toy),
    pp=PipelinePlan(first=("stem",), repeated="layers", last=("final",), depth_option="layers", tied_by="tie"),
)


def _register_toy():
    if "_toy" not in _registry._MODELS:
        _registry.register_model("_toy", ToyConfig, plan=TOY_PLAN)(Toy)


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test (the registry is restored after it)."""
    for table in ("_MODELS", "_PLANS", "_PLANS_BY_TYPE"):
        monkeypatch.setattr(_registry, table, dict(getattr(_registry, table)))
    _register_toy()
    return "_toy"


def test_toy_family_capabilities_come_from_its_plan(toy):
    from kiln.config import ConfigError, validate
    from kiln.parallel import check_parallel_config

    assert toy in kiln.models.models_with("tp") and toy in kiln.models.models_with("pp")
    base = {"model": {"name": toy}, "train": {"max_steps": 1}, "data": {"name": "synthetic_tokens"}}
    check_parallel_config(validate({**base, "parallel": {"tp": 2, "pp": 2}}))  # accepted: the plan makes it splittable
    with pytest.raises(ConfigError,
                       match=r"parallel.tp=3 does not divide model.hidden=32; choose tp in \{1, 2, 4, 8, 16\}"):
        check_parallel_config(validate({**base, "parallel": {"tp": 3}}))
    with pytest.raises(ConfigError, match=r"model.tie=true ties .* set model.tie=false"):
        check_parallel_config(validate({**base, "model": {"name": toy, "tie": True}, "parallel": {"pp": 2}}))
    with pytest.raises(ConfigError, match=r"parallel.tp=2 needs a model family with a tensor-parallel plan "
                                          r"\(_toy, bert, gpt, hf llama: LlamaForCausalLM, .*hf gpt2: GPT2LMHeadModel, hf bert: BertForMaskedLM\); "
                                          r"model 'vit' has none"):
        check_parallel_config(validate({**base, "model": {"name": "vit"}, "parallel": {"tp": 2}}))


def test_toy_family_sharded_set_and_stages_come_from_its_plan(toy):
    from kiln.parallel._pp import cut_stage, stage_of_parameters, stage_ranges
    from kiln.parallel._tp import tp_sharded_names

    with torch.device("meta"):
        model = create_model(toy)
    expected = {"stem.lookup.weight", "final.proj.weight", "final.proj.bias"}
    for i in range(4):
        expected |= {f"layers.{i}.up.weight", f"layers.{i}.up.bias", f"layers.{i}.down.weight"}
    assert tp_sharded_names(model, 2) == expected
    owner = stage_of_parameters(model, stage_ranges(4, 2))
    assert {n for n, s in owner.items() if s == 0} == {"stem.lookup.weight"} | {
        f"layers.{i}.{m}.{p}" for i in (0, 1) for m in ("ln", "up", "down") for p in ("weight", "bias")}
    last = cut_stage(create_model(toy), stage_ranges(4, 2), 1)
    assert isinstance(last.stem, nn.Identity) and isinstance(last.layers[0], nn.Identity)
    assert not isinstance(last.final, nn.Identity)
    with pytest.raises(ValueError, match="Set model.tie=false"):
        cut_stage(create_model(toy, tie=True), stage_ranges(4, 2), 0)


def _toy_worker(rank, world, layout_kw):
    """tp=2 or pp=2 on the toy family, against the same model in one process."""
    from kiln.parallel._layout import parallelize
    from kiln.parallel._mesh import Layout
    from kiln.parallel._tp import gather_logits

    _register_toy()
    torch.manual_seed(0)
    model = create_model("_toy")
    ref = create_model("_toy")
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(48, (4, 8), generator=g), torch.randint(48, (4, 8), generator=g)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    ref_loss = loss_fn(ref(ids), targets)
    ref_loss.backward()
    par = parallelize(model, Layout(**layout_kw), loss_fn=loss_fn, microbatches=2)
    if par.pipeline is not None:
        loss = par.pipeline.step(ids, targets)
    else:
        with par.loss_context():
            loss = loss_fn(model(ids), targets)
            loss.backward()
        loss = par.value(loss)
        assert torch.allclose(gather_logits(model(ids)).detach(), ref(ids).detach(), atol=1e-6)
    shapes = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
              for n, p in par.model.named_parameters()}
    ref_grads = dict(ref.named_parameters())
    grads = {}
    for n, p in par.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[n] = float((grad - ref_grads[n].grad).abs().max())
    return dict(loss=float(loss), ref_loss=float(ref_loss), shapes=shapes, grad_err=grads)


@pytest.mark.distributed
def test_toy_family_trains_with_tp_and_pp_from_its_plan_alone():
    for layout, check in (({"tp": 2}, "tp"), ({"pp": 2}, "pp")):
        outs = run_distributed(_toy_worker, 2, layout)
        for rank, out in enumerate(outs):
            assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-6, abs=1e-6)
            assert max(out["grad_err"].values()) < 1e-6, out["grad_err"]
            shapes = out["shapes"]
            if check == "tp":  # the plan's splits, on every rank
                assert shapes["stem.lookup.weight"] == (24, 8)  # (V/tp, C)
                assert shapes["layers.0.up.weight"] == (16, 8) and shapes["layers.0.up.bias"] == (16,)  # (F/tp, C)
                assert shapes["layers.0.down.weight"] == (8, 16) and shapes["layers.0.down.bias"] == (8,)  # (C, F/tp)
                assert shapes["final.proj.weight"] == (24, 8) and shapes["final.proj.bias"] == (24,)  # (V/tp, C)
                assert shapes["layers.0.ln.weight"] == (8,)  # replicated
            else:  # the plan's stages: rank 0 the stem and layers 0-1, rank 1 layers 2-3 and the final
                owned = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers") else "") for n in shapes}
                assert owned == ({"stem", "layers.0", "layers.1"} if rank == 0 else {"layers.2", "layers.3", "final"})
