"""data.name=tokens (kiln/data/_tokens.py): nanoGPT-format token files read through a memmap in
windows of seq_len + 1, the generated stream used without a file, the errors a bad file gets
before anything is built, and a mid-epoch resume, in another number of processes too, that
trains on exactly the windows an uninterrupted run does."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.commands import main
from kiln.config import ConfigError, load_config, validate
from kiln.data import build_dataset
from kiln.data._tokens import token_stream
from kiln.train import load_checkpoint
from launched import kiln_here

ROOT = Path(__file__).resolve().parents[1]
SMALL_GPT2 = str(ROOT / "configs" / "gpt2_small.py")
# configs/gpt2_small.py shrunk to a model that trains in a blink: its data follow the model
TINY = ["model.vocab_size=300", "model.seq_len=16", "model.dim=16", "model.depth=2", "model.heads=2"]


def _write(path: Path, ids, dtype=np.uint16) -> str:
    np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def _window_values(dataset) -> list[tuple[list[int], list[int]]]:
    return [(x.tolist(), y.tolist()) for x, y in (dataset[i] for i in range(len(dataset)))]


# --------------------------------------------------------------------------- windows


def test_windows_are_seq_len_plus_one_tokens_with_stride_seq_len(tmp_path):
    train = _write(tmp_path / "train.bin", np.arange(103) * 7 % 1000)  # 103 ids: (103 - 1) // 10 = 10 windows
    val = _write(tmp_path / "val.bin", 999 - np.arange(45))  # 4 windows, 3 asked for
    splits = build_dataset("tokens", path=train, val_path=val, seq_len=10, vocab_size=1000, val_samples=3)
    ids = list(np.arange(103) * 7 % 1000)
    assert len(splits.train) == 10 and len(splits.val) == 3
    assert _window_values(splits.train) == [(ids[10 * i:10 * i + 10], ids[10 * i + 1:10 * i + 11]) for i in range(10)]
    assert _window_values(splits.val)[2] == (list(range(979, 969, -1)), list(range(978, 968, -1)))
    x, y = splits.train[-1]
    assert x.dtype == y.dtype == torch.int64 and x.shape == (10,)
    assert (splits.task, splits.num_classes, splits.input_shape) == ("lm", 1000, (10,))
    with pytest.raises(IndexError):
        splits.train[10]
    # the whole file is not loaded: a window maps only its pages, and the data set pickles small
    assert len(pickle.dumps(splits.train)) < 1000
    again = pickle.loads(pickle.dumps(splits.train))
    assert _window_values(again) == _window_values(splits.train)


def test_without_val_path_the_end_of_the_file_is_held_out(tmp_path):
    path = _write(tmp_path / "train.bin", np.arange(200))
    splits = build_dataset("tokens", path=path, seq_len=8, vocab_size=200, val_samples=5)
    # the last 5 * 8 + 1 = 41 tokens are validation; training's 159 make (159 - 1) // 8 = 19 windows
    assert len(splits.train) == 19 and len(splits.val) == 5
    val = _window_values(splits.val)
    assert val[0][0][0] == 159 and val[-1][1][-1] == 199
    assert max(max(y) for _, y in _window_values(splits.train)) == 152 < 159  # no token of both
    capped = build_dataset("tokens", path=path, seq_len=8, vocab_size=200, val_samples=5, num_samples=4)
    assert _window_values(capped.train) == _window_values(splits.train)[:4]


@pytest.mark.parametrize("vocab_size, dtype, top", [(70_000, None, 69_999), (1000, "uint32", 999),
                                                    (65_536, None, 65_535)])
def test_uint32_files_for_large_vocabularies_and_where_asked(tmp_path, vocab_size, dtype, top):
    ids = np.array([top, 0, 1, top - 1, 5, 6, 7, 8, 9], dtype=np.int64)
    file_dtype = np.uint32 if (dtype == "uint32" or vocab_size > 65_536) else np.uint16
    path = _write(tmp_path / "t.bin", ids, file_dtype)
    splits = build_dataset("tokens", path=path, val_path=path, seq_len=4, vocab_size=vocab_size, dtype=dtype)
    assert splits.train[0][0].tolist() == [top, 0, 1, top - 1] and splits.train[1][1].tolist() == [6, 7, 8, 9]


def test_a_config_takes_seq_len_vocab_and_dtype_from_the_model(tmp_path):
    path = _write(tmp_path / "train.bin", np.arange(3000) % 300)
    cfg = load_config(SMALL_GPT2, [*TINY, f"data.path={path}"])
    assert dict(cfg.data.args) == {"val_samples": 128, "seq_len": 16, "vocab_size": 300, "dtype": "uint16"}
    assert cfg.data.path == path and cfg.data.val_path is None
    cfg = load_config(SMALL_GPT2, [*TINY, f"data.path={path}", "data.args.seq_len=8", "data.args.val_samples=2"])
    assert cfg.data.args.seq_len == 8  # shorter than the model's positions is allowed
    full = load_config(SMALL_GPT2)
    assert (full.data.args.seq_len, full.data.args.vocab_size) == (1024, 50304)


# --------------------------------------------------------------------------- the generated stream


def test_the_generated_stream_is_reproducible_in_range_and_has_structure_to_learn():
    ids = token_stream(50304, 100_000, seed=3)
    assert ids.dtype == np.uint16 and int(ids.max()) < 50304
    assert np.array_equal(ids, token_stream(50304, 100_000, seed=3, corpus_seed=0))
    assert not np.array_equal(ids[:1000], token_stream(50304, 100_000, seed=4)[:1000])
    # within a chain of 2,048 tokens each token is followed by one of at most 4 successors
    a, b = ids[:-1].astype(np.int64), ids[1:].astype(np.int64)
    inside = np.arange(len(a)) % 2048 != 2047
    pairs = np.unique(a[inside] * 50304 + b[inside])
    assert np.bincount(pairs // 50304).max() <= 4
    counts = np.bincount(ids, minlength=50304)
    assert counts.max() > 100 * counts.mean()  # a skewed unigram law: the first thing a model learns
    assert token_stream(70_000, 1000, seed=0).dtype == np.uint32


def test_without_a_path_the_splits_are_generated_and_the_training_seed_changes_nothing():
    a = build_dataset("tokens", seed=0, seq_len=32, vocab_size=512, num_samples=20, val_samples=6)
    b = build_dataset("tokens", seed=9, seq_len=32, vocab_size=512, num_samples=20, val_samples=6)
    assert (len(a.train), len(a.val)) == (20, 6)
    assert _window_values(a.train) == _window_values(b.train)
    assert _window_values(a.val) != _window_values(a.train)[:6]  # validation is a walk of its own
    x0, y0 = a.train[0]
    x1, _ = a.train[1]
    assert y0[-1] == x1[0] and bool((x0[1:] == y0[:-1]).all())  # windows chain
    assert _window_values(build_dataset("tokens", seq_len=32, vocab_size=512, num_samples=20, val_samples=6,
                                        corpus_seed=1).train) != _window_values(a.train)


# --------------------------------------------------------------------------- errors before anything is built


def _config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(SMALL_GPT2, [*TINY, *overrides])
    message = str(info.value)
    assert "\n" not in message
    return message


def test_file_errors_name_the_file_and_the_problem(tmp_path):
    good = _write(tmp_path / "good.bin", np.arange(600) % 300)
    empty = _write(tmp_path / "empty.bin", [])
    short = _write(tmp_path / "short.bin", np.arange(16))  # one window of 16 needs 17 tokens
    beyond = _write(tmp_path / "beyond.bin", [*range(100), 300, *range(100)])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02\x00\x03")  # 5 bytes: two uint16 ids and half of one
    wide = _write(tmp_path / "wide.bin", np.arange(4000) % 300, np.uint32)  # uint32 ids read as uint16
    missing = str(tmp_path / "nowhere.bin")
    cases = [
        ([f"data.path={missing}"], [f"data.path={missing}", "no such file"]),
        ([f"data.path={good}", f"data.val_path={missing}"], ["data.val_path=", "no such file"]),
        ([f"data.path={empty}"], ["empty.bin is empty"]),
        ([f"data.path={good}", f"data.val_path={short}"], ["holds 16 tokens, fewer than the 17 of one window"]),
        ([f"data.path={beyond}", f"data.val_path={good}"], ["token id 300, beyond the vocabulary of 300"]),
        ([f"data.path={good}", f"data.val_path={odd}"], ["5 bytes, not a whole number of uint16 ids",
                                                         "data.args.dtype"]),
        ([f"data.path={wide}"], ["as in a file of uint32 ids", "data.args.dtype=uint32"]),
        # 600 tokens cannot hold one training window and the 128 held-out ones
        ([f"data.path={good}"], ["fewer than the 2,066", "data.args.val_samples=128", "data.val_path"]),
        ([f"data.path={good}", f"data.val_path={good}", "data.args.num_samples=100"],
         ["data.args.num_samples=100 windows", "fewer than the 1,601"]),
    ]
    for overrides, names in cases:
        message = _config_error(overrides)
        assert all(name in message for name in names), (overrides, message)


def test_key_errors_name_the_key_and_the_fix(tmp_path):
    good = _write(tmp_path / "good.bin", np.arange(600) % 300)
    cases = [
        ([f"data.path={good}", "data.name=text_lm", "data.args={}"], ["data.path=", "data.name=text_lm reads none",
                                                                       "tokens"]),
        ([f"data.val_path={good}"], ["data.val_path is set without data.path"]),
        ([f"data.args.path={good}"], ["data.args.path", f"set data.path={good}"]),
        (["data.args.seq_len=32"], ["data.args.seq_len=32 exceeds model.seq_len=16"]),
        (["data.args.vocab_size=400"], ["data.args.vocab_size=400 exceeds model.vocab_size=300"]),
        (["model.vocab_size=70000", "data.args.dtype=uint16"], ["data.args.dtype=uint16", "uint32"]),
        (["data.args.val_samples=0"], ["data.args.val_samples=0 must be a positive integer"]),
        (["data.args.dtype=int8"], ["data.args.dtype='int8'", "'uint16', 'uint32'"]),
    ]
    for overrides, names in cases:
        message = _config_error(overrides)
        assert all(name in message for name in names), (overrides, message)


def test_a_model_kiln_does_not_size_needs_seq_len_and_vocab_size():
    tree = {"model": {"_target_": "torch.nn.Embedding", "num_embeddings": 256, "embedding_dim": 8},
            "data": {"name": "tokens"}, "train": {"max_steps": 1}}
    with pytest.raises(ConfigError, match="data.args.seq_len is missing"):
        validate(tree)
    tree["data"]["args"] = {"seq_len": 32}
    with pytest.raises(ConfigError, match="data.args.vocab_size is missing"):
        validate(tree)
    tree["data"]["args"] = {"seq_len": 32, "vocab_size": 70_000}
    assert validate(tree)["data"]["args"] == {"seq_len": 32, "vocab_size": 70_000, "dtype": "uint32"}


def test_kiln_train_refuses_a_bad_token_file_in_one_line_before_the_run_directory(tmp_path, capsys):
    beyond = _write(tmp_path / "beyond.bin", [*range(400), 7000])
    runs = tmp_path / "runs"
    code = main(["train", SMALL_GPT2, *TINY, f"data.path={beyond}", "data.args.val_samples=2",
                 f"train.output_dir={runs}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("kiln: error: data.path=") and "token id 7,000, beyond the vocabulary of 300" in err
    assert not runs.exists()


# --------------------------------------------------------------------------- resume


def _token_files(tmp_path: Path) -> list[str]:
    g = np.random.default_rng(0)
    # 50 training windows of 16 in steps of 8: 6 steps an epoch (2 windows dropped), so 14 steps
    # cross two epoch ends
    train = _write(tmp_path / "train.bin", g.integers(0, 300, 50 * 16 + 1))
    val = _write(tmp_path / "val.bin", g.integers(0, 300, 8 * 16 + 1))
    return [f"data.path={train}", f"data.val_path={val}", "data.args.val_samples=8", "data.batch_size=8",
            "data.eval_batch_size=8", "train.precision=fp64", "optim.warmup_steps=0", "optim.schedule=constant",
            "train.eval_every=0", "train.log_every=1", "train.progress=none"]


def _run(out: Path, *args: str, nproc: int = 1) -> Path:
    done = kiln_here("train", SMALL_GPT2, *TINY, *args, f"train.output_dir={out}", "--nproc", str(nproc))
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = out.iterdir()
    return run


def _resume(run: Path, *args: str, nproc: int = 1) -> None:
    done = kiln_here("train", "--resume", str(run), *args, "--nproc", str(nproc))
    assert done.returncode == 0, done.stderr[-3000:]


def _same_training(a: Path, b: Path, tol: float) -> None:
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert sa["steps"] == sb["steps"] == 14
    assert sb["final_train_loss"] == pytest.approx(sa["final_train_loss"], rel=tol, abs=0)
    wa, wb = (load_checkpoint(r / "checkpoints" / "final")["model"] for r in (a, b))
    for key in wa:
        assert wa[key].dtype == torch.float64
        if tol == 0:
            assert torch.equal(wa[key], wb[key]), key
        else:
            torch.testing.assert_close(wb[key], wa[key], rtol=tol, atol=tol)


@pytest.mark.distributed
def test_a_mid_epoch_resume_trains_on_the_same_windows_in_one_process_or_two(tmp_path):
    common = _token_files(tmp_path)
    whole = _run(tmp_path / "whole", *common, "train.max_steps=14")
    # stopped at step 9 (mid-epoch 1), resumed in the same layout with loader workers, which get
    # the data set by pickle and map the file themselves: bitwise the same
    part = _run(tmp_path / "part", *common, "train.max_steps=9")
    _resume(part, "train.max_steps=14", "data.workers=2")
    _same_training(whole, part, tol=0)
    # two processes for 9 steps, then one: the same windows at every step (the reduction over
    # two ranks rounds differently, hence fp64 and 1e-12)
    two = _run(tmp_path / "two", *common, "train.max_steps=9", "data.workers=1", nproc=2)
    _resume(two, "train.max_steps=14")
    _same_training(whole, two, tol=1e-12)
