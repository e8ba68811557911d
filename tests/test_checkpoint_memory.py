"""A checkpoint save writes from the arena itself: no second copy of the model and optimizer
state in memory while it writes, and the run it resumes is still the same to the bit.

The bytes a save allocates are the profiler's record of every CPU allocation and free during
``save_sharded`` (the running peak of their sum, as ``summary.json``'s tensor peak is taken).
Before the arena's state was written in place, a save of an AdamW model allocated 113% of the
state's bytes: the optimizer's state dict copied the moments, and DCP copied every view of an
arena it wrote (each copy kept until the file was done).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kiln.optim as ko
from kiln._profiling import profiled
from kiln.models import create_model
from kiln.parallel import load_sharded, save_sharded
from kiln.train.parts import running_peak

ARCH = dict(vocab_size=4096, seq_len=16, dim=128, depth=2, heads=2, tie_embeddings=True)


def _build():
    torch.manual_seed(0)
    model = create_model("gpt", **ARCH)
    return model, ko.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(ARCH["vocab_size"], (4, ARCH["seq_len"] + 1), generator=g)
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()


def _state_bytes(model, opt):
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")
    return params + moments


def _resume_and_compare(path, model, opt, wrap=lambda o: o):
    """Loads ``path`` into a fresh model and optimizer (``wrap``ped as ``opt`` was), takes one
    more step with both, and asserts the parameters and the optimizer's state equal to the bit."""
    resumed, resumed_opt = _build()
    resumed_opt = wrap(resumed_opt)
    assert load_sharded(path, resumed, resumed_opt) == {"step": 1}
    for m, o in ((model, opt), (resumed, resumed_opt)):
        _step(m, o, 1)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for st_a, st_b in zip(opt.state.values(), resumed_opt.state.values()):
        for k in st_a:
            assert torch.equal(st_a[k], st_b[k]), k


def test_a_save_allocates_under_5_percent_of_the_state_and_resumes_to_the_bit(tmp_path):
    model, opt = _build()
    _step(model, opt, 0)
    state = _state_bytes(model, opt)
    assert state > 10 * 2**20  # the parameters and two AdamW moments of 0.92 M parameters
    with profiled(profile_memory=True) as prof:
        save_sharded(tmp_path / "ck", model, opt, {"step": 1})
    allocated = running_peak(prof)
    assert allocated <= 0.05 * state, f"the save allocated {allocated / state:.1%} of the state's bytes"

    _resume_and_compare(tmp_path / "ck", model, opt)


def test_state_dict_copies_and_copy_false_gives_the_arena_state():
    model, opt = _build()
    _step(model, opt, 0)
    copied, views = opt.state_dict(), opt.state_dict(copy=False)
    a, b = copied["state"][0]["exp_avg"], views["state"][0]["exp_avg"]
    assert torch.equal(a, b)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # a copy: loading it elsewhere never aliases
    assert b.data_ptr() == opt.state[next(iter(model.parameters()))]["exp_avg"].data_ptr()  # the arena's own


def test_state_on_a_gpu_is_written_a_tensor_a_file_and_resumes_to_the_bit(tmp_path, monkeypatch):
    """DCP's one file per rank holds every tensor of the file in host memory until it is closed
    (a GPU run's whole state, in pinned memory: +2.8 GB of RSS on GPT-2 small on an H200). State
    on a device is written one tensor a file, copied as it is written (no pinned staging); here
    the CPU takes that path too, and the checkpoint is the same training."""
    import kiln.parallel._checkpoint as ckpt

    cpu, gpu = ckpt._writer(tmp_path, {"w": torch.zeros(2)}), ckpt._writer(tmp_path, {"w": torch.zeros(2, device="meta")})
    assert (cpu.single_file_per_rank, gpu.single_file_per_rank, gpu.per_thread_copy_ahead) == (True, False, 0)

    real = ckpt._writer
    monkeypatch.setattr(ckpt, "_writer", lambda path, tensors: real(path, {"w": torch.zeros(1, device="meta")}))
    model, opt = _build()
    _step(model, opt, 0)
    save_sharded(tmp_path / "ck", model, opt, {"step": 1})
    files = sorted((tmp_path / "ck").glob("*.distcp"))
    largest = max(max(p.numel() * p.element_size() for p in model.parameters()), 1)
    tensors = len(model.state_dict()) + sum(len([k for k in st if k != "step"]) for st in opt.state.values())
    assert len(files) >= tensors  # (step counters are small tensors of their own too)
    assert max(f.stat().st_size for f in files) < largest + 2**16

    _resume_and_compare(tmp_path / "ck", model, opt)


def test_a_zero_optimizer_is_saved_from_its_shards_views_and_resumes_to_the_bit(tmp_path):
    """ZeRO-1 in one process (its shard: the whole arena): the save writes this rank's pieces from
    the shard's own state (the wrapper's ``state_dict(copy=False)``, no gather, no copy), and
    the resumed wrapper takes its pieces back where ``shard_pieces()`` says."""
    from kiln.parallel import ZeroOptimizer

    model, opt = _build()
    zero = ZeroOptimizer(opt, stage=1)
    assert zero.shards and zero.shard_pieces()
    _step(model, zero, 0)
    state = _state_bytes(model, zero)
    with profiled(profile_memory=True) as prof:
        save_sharded(tmp_path / "ck", model, zero, {"step": 1})
    allocated = running_peak(prof)
    assert allocated <= 0.05 * state, f"the save allocated {allocated / state:.1%} of the state's bytes"

    _resume_and_compare(tmp_path / "ck", model, zero, wrap=lambda o: ZeroOptimizer(o, stage=1))
