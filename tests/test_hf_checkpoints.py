"""Hugging Face checkpoints in and out of kiln, in any layout (issue 14).

In: a local directory written by ``save_pretrained`` (safetensors, sharded into several files)
loads into one process and into dp (FSDP2), tp and pp layouts, where each rank reads only the
part of each tensor it holds and the first forward equals transformers' own model. Out: a run
from that directory writes ``RUN_DIR/hf/``, which ``from_pretrained`` loads as the model of the
run's last step, in one process and in two; ``kiln export`` writes any step's checkpoint and
refuses, in one line, what it cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from kiln.commands import main  # noqa: E402
from kiln.train import load_checkpoint  # noqa: E402
from launched import kiln_here, only_run

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.arange(48).reshape(3, 16) * 37 % 256  # (B, T) token ids for comparing logits


def _source(family: str):
    """A tiny model of ``family``, seeded: ``llama`` (grouped-query attention, untied head),
    ``llama-bf16`` (the same, saved in bfloat16), ``gpt2`` (head tied to the token embedding),
    ``gpt2-untied``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    if family.startswith("llama"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                             bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
        return model.to(torch.bfloat16) if family == "llama-bf16" else model
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                                      eos_token_id=0, tie_word_embeddings=family == "gpt2",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # layouts draw other masks


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """``pretrained(family) -> directory``: the source model written by save_pretrained in
    safetensors shards of at most 40 KB (several files and an index)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            _source(family).save_pretrained(path, max_shard_size="40KB")
            assert len(list(path.glob("*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").is_file()
            made[family] = path
        return made[family]

    return get


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# ------------------------------------------------------------------------------------------ in


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_local_directory_loads_lazily_in_one_process_as_transformers_loads_it(pretrained, family):
    import kiln.hf

    path = pretrained(family)
    ref = _reference(path)
    lazy = kiln.hf.from_pretrained(str(path), lazy=True)
    assert all(p.is_meta for p in lazy.parameters())  # built from config.json: no weights, no memory
    buffers = dict(lazy.named_buffers())
    for name, b in ref.named_buffers():  # rotary frequencies are computed for real, not left on meta
        assert torch.equal(buffers[name], b), name
    read = kiln.hf.load_weights(lazy)
    assert read == sum(p.numel() for p in ref.parameters())  # every tensor once (a tied one once)
    assert kiln.hf.weights_source(lazy) is None  # loaded: nothing left to read
    assert torch.allclose(_logits(lazy), _logits(ref), rtol=0, atol=1e-5)
    if family == "gpt2":
        assert lazy.lm_head.weight is lazy.transformer.wte.weight
    # in plain Python the default loads, as transformers does; kiln train's build defers
    eager = kiln.hf.from_pretrained(str(path))
    assert not any(p.is_meta for p in eager.parameters()) and torch.equal(_logits(eager), _logits(ref))
    with kiln.hf.deferred_weights():
        assert all(p.is_meta for p in kiln.hf.from_pretrained(str(path)).parameters())
    with torch.device("meta"):  # shapes only (layout checks, kiln plan): transformers' own would refuse
        assert all(p.is_meta for p in kiln.hf.from_pretrained(str(path)).parameters())


def test_a_base_model_reads_the_task_models_checkpoint_and_bad_directories_are_refused(pretrained, tmp_path):
    import kiln.hf

    path = pretrained("llama")
    ref = _reference(path)
    # LlamaModel holds "layers.0...", the file "model.layers.0...": the base model's prefix is matched
    base = kiln.hf.from_pretrained(str(path), model_class="AutoModel", lazy=True)
    kiln.hf.load_weights(base)
    with torch.no_grad():
        assert torch.equal(base(IDS).last_hidden_state, ref.model(IDS).last_hidden_state)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((path / "config.json").read_text())
    torch.save(ref.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors weights \(pytorch_model\.bin are pickles"):
        kiln.hf.from_pretrained(str(pickled), lazy=True)

    wider = tmp_path / "wider"  # another config's checkpoint: shapes differ
    ref.config.save_pretrained(wider)
    from safetensors.torch import save_file

    save_file({k: torch.zeros(2 * v.shape[0], *v.shape[1:]) for k, v in ref.state_dict().items()},
              wider / "model.safetensors")
    shapes = r"has other shapes for model\.embed_tokens\.weight \(256, 32\) \(file: \(512, 32\)\)"
    with pytest.raises(ValueError, match=shapes):
        kiln.hf.load_weights(kiln.hf.from_pretrained(str(path), lazy=True), wider)
    (wider / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"},
              wider / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks lm_head\.weight \(1 tensors\)"):
        kiln.hf.load_weights(kiln.hf.from_pretrained(str(path), lazy=True), wider)


def _load_in_layouts(rank: int, world: int, cases: list[tuple[str, dict, int]]) -> list[tuple]:
    """One rank, each case in turn: build lazily, lay out, read. What it read, what it holds,
    how many of its tensors it holds in another shape than the file's, and the first forward's
    logits (None on a pipeline rank without the last stage)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    import kiln.hf
    from kiln.parallel import Layout, parallelize

    out = []
    for path, layout, zero in cases:
        model = kiln.hf.from_pretrained(path, lazy=True)
        lay = Layout(**layout)
        par = parallelize(model, lay, zero=zero, microbatches=3,
                          loss_fn=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        # laid out with no memory yet: no rank ever allocates the whole model, only its part when read
        assert all(p.is_meta for p in model.parameters()) and all(p.is_meta for p in par.model.parameters())
        read = kiln.hf.load_weights(par.model, path)
        shapes = {}
        for file in Path(path).glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        held = reshaped = 0
        for name, p in par.model.named_parameters():
            held += (p.to_local() if isinstance(p, DTensor) else p).numel()
            reshaped += tuple(p.shape) != shapes[name]  # GPT-2's c_attn as (C, 3, C) under tp
        with torch.no_grad():
            logits = par.pipeline.forward(IDS) if par.pipeline is not None else par.logits(par.model(IDS).logits)
        out.append((read, held, reshaped, None if logits is None else logits.detach()))
    return out


# (family, layout, zero): 2 processes, then 4 (one group of processes for each, to spare the start-up)
LAYOUTS = {
    2: [("llama", dict(dp=2), 3), ("gpt2", dict(dp=2), 3), ("llama", dict(tp=2), 0), ("gpt2", dict(tp=2), 0),
        ("llama", dict(pp=2), 0), ("gpt2-untied", dict(pp=2), 0)],
    4: [("llama", dict(tp=2, pp=2), 0), ("gpt2-untied", dict(dp=2, tp=2), 3)],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_part_and_the_first_forward_equals_transformers(pretrained, world):
    """FSDP2 (dp=2, zero=3), tp=2, pp=2 (1F1B), tp=2 x pp=2 and dp=2 x tp=2 with FSDP2."""
    from kiln.launch.testing import run_distributed

    cases = [(str(pretrained(family)), layout, zero) for family, layout, zero in LAYOUTS[world]]
    results = run_distributed(_load_in_layouts, world, cases)
    for i, (path, layout, zero) in enumerate(cases):
        ref = _reference(Path(path))
        total = sum(p.numel() for p in ref.parameters())
        ranks = [r[i] for r in results]
        for rank, (read, held, reshaped, logits) in enumerate(ranks):
            # exactly its own part of every tensor, straight from the files; never the whole model
            assert read == held < total, (layout, rank, read, held, total)
            # (C, 3, C) shards are read as 3 runs of (C, C/tp) from the file's (C, 3C)
            assert reshaped == (4 if "gpt2" in path and "tp" in layout else 0), (layout, rank, reshaped)
            if logits is not None:
                assert torch.allclose(logits, _logits(ref), rtol=0, atol=1e-5), (layout, rank)
        assert any(r[3] is not None for r in ranks)
        if layout == dict(dp=2):  # FSDP2 alone: the two shards add up to the model
            assert sum(r[0] for r in ranks) == total


# ----------------------------------------------------------------------------------------- out


def _config(tmp_path: Path, source: Path) -> Path:
    config = tmp_path / "from_pretrained.py"
    config.write_text(textwrap.dedent(f'''
        import kiln.hf
        from kiln.config import LazyCall as L

        model = L(kiln.hf.from_pretrained)(path={str(source)!r}, model_class="AutoModelForCausalLM")
        data = dict(name="text_lm", batch_size=8, args=dict(seq_len=16, num_samples=64, val_samples=16))
        optim = dict(lr=1e-2, schedule="constant")
        # fp32, not auto (bf16-mixed where bf16 is native): runs are compared in fp32 round-off
        train = dict(max_steps=4, log_every=1, eval_every=0, checkpoint_every=2, progress="none", precision="fp32")
    '''))
    return config


def _model_at(checkpoint: Path, source: Path):
    """kiln's model at a checkpoint, in one process: the source's architecture with the
    checkpoint's tensors (read by load_checkpoint, not by the export under test)."""
    model = _reference(source)
    weights = load_checkpoint(checkpoint)["model"]
    state = {k: weights[k].reshape(v.shape) for k, v in model.state_dict().items() if k in weights}
    model.load_state_dict(state, strict=False)
    assert set(weights) <= set(model.state_dict())
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "llama-bf16"])
def test_a_run_from_a_local_directory_writes_hf_that_from_pretrained_loads_as_its_last_step(pretrained, tmp_path,
                                                                                           family):
    from safetensors import safe_open

    source = pretrained(family)
    assert main(["train", str(_config(tmp_path, source)), f"train.output_dir={tmp_path / 'runs'}"]) == 0
    run = only_run(tmp_path / "runs")
    exported = _reference(run / "hf")
    last = _model_at(run / "checkpoints" / "final", source)
    assert torch.allclose(_logits(exported), _logits(last), rtol=0, atol=1e-5)
    assert (_logits(exported) - _logits(_reference(source))).abs().max() > 1e-3  # it trained
    saved, src = (json.loads((d / "config.json").read_text()) for d in (run / "hf", source))
    assert {k: v for k, v in saved.items() if k not in ("transformers_version", "dtype")} == \
        {k: v for k, v in src.items() if k not in ("transformers_version", "dtype")}  # the config matches the model
    # in the dtype kiln trained it (fp32), also from a bfloat16 checkpoint
    assert saved["dtype"] == "float32" and src["dtype"] == ("bfloat16" if family == "llama-bf16" else "float32")
    assert all(p.dtype == torch.float32 for p in exported.parameters())
    if family == "gpt2":  # tied stays tied: one tensor on disk, one Parameter when loaded
        keys = set()
        for file in (run / "hf").glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                keys |= set(f.keys())
        assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
        assert exported.lm_head.weight is exported.transformer.wte.weight


TWO_PROCESS_LAYOUTS = [
    ("llama", ["parallel.zero=3"]),
    ("gpt2", ["parallel.tp=2"]),
    ("gpt2", ["parallel.zero=3"]),  # FSDP2's shards of the (3C,) q/k/v bias are no boxes of its (3, C)
    ("llama", ["parallel.pp=2", "parallel.microbatches=2"]),
]


@pytest.fixture(scope="module")
def two_process_runs(pretrained, tmp_path_factory):
    """Each layout's config and two-process run directory, the four runs in one pair of gloo
    processes started once (tests/group_runs.py; four launches of kiln train --nproc 2 took
    over 100 s of CPU, most of it six processes importing torch and transformers)."""
    from group_runs import train_in_one_group

    folders = [tmp_path_factory.mktemp(family) for family, _ in TWO_PROCESS_LAYOUTS]
    configs = [_config(folder, pretrained(family)) for folder, (family, _) in zip(folders, TWO_PROCESS_LAYOUTS)]
    runs = [(str(config), [*layout, f"train.output_dir={folder / 'two'}"])
            for config, folder, (_, layout) in zip(configs, folders, TWO_PROCESS_LAYOUTS)]
    return list(zip(configs, train_in_one_group(2, runs)))


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(TWO_PROCESS_LAYOUTS)),
                         ids=[f"{f}-{'-'.join(l)}" for f, l in TWO_PROCESS_LAYOUTS])
def test_a_run_in_two_processes_writes_the_same_hf_as_one_process(pretrained, two_process_runs, tmp_path, case):
    family, layout = TWO_PROCESS_LAYOUTS[case]
    source = pretrained(family)
    config, two = two_process_runs[case]
    assert main(["train", str(config), f"train.output_dir={tmp_path / 'one'}"]) == 0
    one = only_run(tmp_path / "one")
    exported = _reference(two / "hf")
    # the last step's model, written by the two ranks' checkpoint shards
    assert torch.allclose(_logits(exported), _logits(_model_at(two / "checkpoints" / "final", source)),
                          rtol=0, atol=1e-5)
    # and the same training as one process: tensor parallelism sums in another order, which Adam's
    # normalised steps carry into the weights (4 steps at lr 1e-2: about 1e-4 in the logits)
    gap = (_logits(exported) - _logits(_reference(one / "hf"))).abs().max()
    assert gap < (5e-4 if "parallel.tp=2" in layout else 1e-5), gap
    if family == "gpt2" and "parallel.zero=3" in layout:  # and resumes in that layout as if never stopped
        for args in (["--resume", str(two)], [str(config), f"train.output_dir={tmp_path / 'straight'}"]):
            proc = kiln_here("train", *args, "--nproc", "2", *layout, "train.max_steps=5")
            assert proc.returncode == 0, proc.stderr[-3000:]
        assert torch.equal(_logits(_reference(two / "hf")), _logits(_reference(only_run(tmp_path / "straight") / "hf")))


def test_kiln_export_writes_a_middle_steps_weights_and_refuses_in_one_line(pretrained, tmp_path, capsys,
                                                                          monkeypatch):
    source = pretrained("gpt2")
    assert main(["train", str(_config(tmp_path, source)), f"train.output_dir={tmp_path / 'runs'}"]) == 0
    run = only_run(tmp_path / "runs")
    capsys.readouterr()

    out = tmp_path / "step2"
    assert main(["export", str(run), "--step", "2", "--to", "hf", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"kiln: exporting {run} at step 2 (step-00000002)")
    assert lines[-1].startswith(f"kiln: wrote {out}")
    exported = _reference(out).state_dict()
    at_2 = _model_at(run / "checkpoints" / "step-00000002", source).state_dict()
    final = _model_at(run / "checkpoints" / "final", source).state_dict()
    assert all(torch.equal(exported[k], at_2[k]) for k in at_2)  # that step's weights, to the bit
    assert not torch.equal(exported["transformer.h.0.attn.c_attn.weight"], final["transformer.h.0.attn.c_attn.weight"])
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "newest")]) == 0  # default: the newest, step 4
    assert f"{run} at step 4 (final)" in capsys.readouterr().out
    # the export reads the model's tensors only, not the optimizer state beside them
    import kiln.parallel

    whole, _ = kiln.parallel.read_sharded(run / "checkpoints" / "final")
    weights, _ = kiln.parallel.read_sharded(run / "checkpoints" / "final", prefix="model.")
    assert any(k.startswith("optim.state.") for k in whole)
    assert weights.keys() == {k for k in whole if k.startswith("model.")}
    assert all(torch.equal(weights[k], whole[k]) for k in weights)
    asked = []
    real = kiln.parallel.read_sharded
    monkeypatch.setattr(kiln.parallel, "read_sharded", lambda d, prefix="": asked.append(prefix) or real(d, prefix))
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "again")]) == 0
    assert asked == ["model."]
    capsys.readouterr()

    mlp = tmp_path / "mlp"  # a run of kiln's own model (only its config matters: refused before reading)
    mlp.mkdir()
    (mlp / "checkpoints").symlink_to(run / "checkpoints")
    text = (run / "config.yaml").read_text()
    model_block = text[:text.index("data:")]
    (mlp / "config.yaml").write_text(text.replace(model_block, "model:\n  name: mlp\n  in_features: 64\n"
                                                               "  num_classes: 10\n"))
    gone = tmp_path / "gone"  # a run whose pretrained directory was removed since
    gone.mkdir()
    (gone / "checkpoints").symlink_to(run / "checkpoints")
    (gone / "config.yaml").write_text(text.replace(str(source), str(tmp_path / "removed")))
    keep = tmp_path / "full"
    keep.mkdir()
    (keep / "mine.txt").write_text("a user's file")
    refusals = {
        (str(tmp_path), "--to", "hf", str(tmp_path / "x")):
            f"{tmp_path} is not a kiln run directory (no config.yaml in it)",
        (str(run), "--step", "3", "--to", "hf", str(tmp_path / "x")):
            f"{run} has no checkpoint of step 3; it has steps 2, 4 (final): pick one with --step",
        (str(run), "--to", "hf", str(keep)): f"{keep} exists and is not an empty directory",
        (str(run), "--to", "onnx", str(tmp_path / "x")): "--to onnx: the only export format is hf",
        (str(mlp), "--to", "hf", str(tmp_path / "x")):
            "the run's model is kiln.models.mlp.MLPNet, not a transformers model: only Hugging Face models "
            "export to hf",
        (str(gone), "--to", "hf", str(tmp_path / "x")): f"the run's model cannot be built to export it: "
            f"kiln.hf.from_pretrained: {tmp_path / 'removed'} is not a directory",
    }
    for args, message in refusals.items():
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"kiln: error: {message}") and err.count("\n") == 1, (args, err)
    assert (keep / "mine.txt").read_text() == "a user's file" and not (tmp_path / "x").exists()
    assert subprocess.run([sys.executable, "-m", "kiln", "export", "--help"], capture_output=True, text=True,
                          check=True).stdout.count("--to FORMAT DIR") >= 1


def test_from_pretrained_inside_a_users_module_still_starts_from_the_directorys_weights(pretrained, tmp_path):
    """Only a model that is itself from_pretrained's is read after the layout; one inside a
    user's module (a backbone under a new head) is read whole when built, as before."""
    source = pretrained("llama")
    config = tmp_path / "wrapped.py"
    config.write_text(textwrap.dedent(f'''
        from torch import nn

        import kiln.hf
        from kiln.config import LazyCall as L


        class Wrapped(nn.Module):
            def __init__(self, backbone):
                super().__init__()
                self.backbone = backbone

            def forward(self, ids):
                return self.backbone(ids).logits


        model = L(Wrapped)(backbone=L(kiln.hf.from_pretrained)(path={str(source)!r}))
        data = dict(name="text_lm", batch_size=8, args=dict(seq_len=16, num_samples=64, val_samples=16))
        optim = dict(lr=1e-30, schedule="constant", weight_decay=0.0)
        train = dict(max_steps=1, log_every=1, eval_every=0, progress="none", precision="fp32")
    '''))
    assert main(["train", str(config), f"train.output_dir={tmp_path / 'runs'}"]) == 0
    final = load_checkpoint(only_run(tmp_path / "runs") / "checkpoints" / "final")["model"]
    for name, p in _reference(source).state_dict().items():
        assert torch.allclose(final[f"backbone.{name}"], p, rtol=0, atol=1e-20), name  # a random init is ~1e-2 away
