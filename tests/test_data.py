"""Tests for kiln.data: dataset registry, built-in datasets, loaders."""

from __future__ import annotations

import inspect
import json
import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

from kiln.data import (
    DataSplits,
    build_dataset,
    build_loader,
    dataset_signature,
    infinite,
    list_datasets,
    register_dataset,
)


@pytest.fixture(scope="module")
def digits() -> DataSplits:
    return build_dataset("digits", seed=0)


def _tensors(ds):
    return ds.tensors


# --------------------------------------------------------------------------- digits


def test_digits_sizes_dtypes_shapes(digits):
    assert len(digits.train) == 1500 and len(digits.val) == 297
    assert digits.task == "classification" and digits.num_classes == 10
    assert digits.input_shape == (1, 8, 8)
    for ds in (digits.train, digits.val):
        x, y = _tensors(ds)
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)
        assert y.dtype == torch.int64 and y.shape == (len(ds),)
        assert set(y.tolist()) == set(range(10))
    x0, y0 = digits.train[0]
    assert x0.shape == (1, 8, 8) and y0.dim() == 0


def test_digits_stratified(digits):
    train_counts = _tensors(digits.train)[1].bincount(minlength=10)
    val_counts = _tensors(digits.val)[1].bincount(minlength=10)
    assert (val_counts > 0).all()
    # Stratified: every class's val share matches its overall share (297/1797) within one sample.
    expected = (train_counts + val_counts).double() * 297 / 1797
    assert (val_counts.double() - expected).abs().max() <= 1.0


def test_digits_standardized_with_train_stats(digits):
    x_train = _tensors(digits.train)[0]
    assert abs(x_train.mean().item()) < 1e-5
    assert abs(x_train.std().item() - 1.0) < 1e-5
    x_val = _tensors(digits.val)[0]
    # Val uses the train statistics, so it is close to but not exactly standardized.
    assert abs(x_val.mean().item()) < 0.1 and abs(x_val.std().item() - 1.0) < 0.1
    # Raw digits are integers 0..16: standardization is affine, so 17 levels at most.
    assert torch.unique(x_train).numel() == 17


def test_digits_split_independent_of_training_seed(digits):
    other = build_dataset("digits", seed=12345)
    for a, b in zip(_tensors(digits.train) + _tensors(digits.val), _tensors(other.train) + _tensors(other.val)):
        assert torch.equal(a, b)
    # ...but the split seed does change it, and train/val never overlap.
    resplit = build_dataset("digits", seed=0, split_seed=1)
    assert not torch.equal(_tensors(resplit.val)[0], _tensors(digits.val)[0])
    train_rows = {tuple(r.tolist()) for r in _tensors(digits.train)[0].flatten(1)}
    val_rows = [tuple(r.tolist()) for r in _tensors(digits.val)[0].flatten(1)]
    # load_digits has a few exact duplicate images; almost none of val may appear in train.
    assert sum(r in train_rows for r in val_rows) <= 5


def test_digits_does_not_import_sklearn_until_built(fresh_python):
    code = "import sys, kiln.data; print('sklearn' in sys.modules)"
    out = fresh_python(code)
    assert out.strip() == "False"


def test_digits_are_load_digits_and_its_split_without_importing_sklearn_once_cached(fresh_python, tmp_path):
    # read from the file scikit-learn ships; the stratified split computed by scikit-learn once
    # and cached; a later process builds digits without importing scikit-learn (2 s of imports)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    code = f"""
import os, sys, json
os.environ["KILN_CACHE_DIR"] = {str(tmp_path)!r}
from kiln.data import build_dataset
d = build_dataset("digits", seed=0, split_seed=2)
print(json.dumps(['sklearn' in sys.modules, d.val.tensors[1].tolist(), d.train.tensors[0].sum().item()]))
"""
    first, second = (json.loads(fresh_python(code)) for _ in range(2))
    assert first[0] and not second[0] and first[1:] == second[1:]
    bunch = load_digits()
    _, val_idx = train_test_split(range(1797), test_size=297, stratify=bunch.target, random_state=2)
    assert second[1] == bunch.target[val_idx].tolist()


# --------------------------------------------------------------------------- synthetic


def _all_equal(a: DataSplits, b: DataSplits) -> bool:
    pairs = zip(_tensors(a.train) + _tensors(a.val), _tensors(b.train) + _tensors(b.val))
    return all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("name", ["synthetic_images", "synthetic_tokens"])
def test_synthetic_reproducible_per_seed(name):
    small = dict(num_samples=128, val_samples=32)
    a, b, c = (build_dataset(name, seed=s, **small) for s in (7, 7, 8))
    assert _all_equal(a, b)
    assert not _all_equal(a, c)
    assert len(a.train) == 128 and len(a.val) == 32


def test_synthetic_images_shapes_and_labels():
    s = build_dataset("synthetic_images", seed=0, image_size=6, channels=3, num_classes=4)
    x, y = _tensors(s.train)
    assert s.task == "classification" and s.num_classes == 4 and s.input_shape == (3, 6, 6)
    assert x.shape == (4096, 3, 6, 6) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and len(s.val) == 512
    counts = y.bincount(minlength=4)
    assert (counts > 0.05 * len(y)).all()  # every class is well represented


def test_synthetic_images_learnable_by_a_linear_model():
    """Labels come from a linear teacher, so a least-squares linear probe beats chance by far."""
    s = build_dataset("synthetic_images", seed=0, num_samples=2048, val_samples=512)
    x, y = _tensors(s.train)
    xv, yv = _tensors(s.val)
    onehot = torch.nn.functional.one_hot(y, 10).double()
    w = torch.linalg.lstsq(x.flatten(1).double(), onehot).solution
    acc = ((xv.flatten(1).double() @ w).argmax(1) == yv).double().mean().item()
    assert acc > 0.6  # chance is 0.1


def test_synthetic_images_up_to_8_pixels_are_the_data_they_always_were():
    """Labels pinned from the builder before large images were labelled from a grid of cells."""
    small = build_dataset("synthetic_images", seed=3, num_samples=64, val_samples=16, image_size=6, channels=3,
                          num_classes=4)
    assert _tensors(small.train)[1][:12].tolist() == [1, 0, 3, 0, 2, 2, 2, 2, 3, 2, 3, 3]
    default = build_dataset("synthetic_images", seed=3, num_samples=64, val_samples=16)
    assert _tensors(default.train)[1][:12].tolist() == [7, 6, 6, 6, 2, 1, 9, 1, 0, 0, 6, 1]


def test_large_synthetic_images_are_labelled_from_8x8_cells_and_stay_learnable():
    """ImageNet's shape costs a teacher of 3 x 8 x 8 weights a class, not 3 x 224 x 224 (150 M at
    1000 classes); the labels are still a linear function of the image, here of its cells' means."""
    big = build_dataset("synthetic_images", seed=0, image_size=224, channels=3, num_classes=1000, num_samples=4,
                        val_samples=2)
    assert big.input_shape == (3, 224, 224) and big.num_classes == 1000 and len(big.train) == 4
    s = build_dataset("synthetic_images", seed=0, image_size=32, channels=1, num_classes=4, num_samples=2048,
                      val_samples=512)
    (x, y), (xv, yv) = _tensors(s.train), _tensors(s.val)
    cells = lambda images: torch.nn.functional.adaptive_avg_pool2d(images, 8).flatten(1).double()  # noqa: E731
    w = torch.linalg.lstsq(cells(x), torch.nn.functional.one_hot(y, 4).double()).solution
    assert ((cells(xv) @ w).argmax(1) == yv).double().mean().item() > 0.6  # chance is 0.25


def test_synthetic_tokens_targets_are_shifted_inputs():
    s = build_dataset("synthetic_tokens", seed=0, num_samples=64, seq_len=16, vocab_size=50, val_samples=8)
    assert s.task == "lm" and s.num_classes == 50 and s.input_shape == (16,)
    for ds in (s.train, s.val):
        inputs, targets = _tensors(ds)
        assert inputs.shape == targets.shape == (len(ds), 16)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        assert inputs.min() >= 0 and max(inputs.max(), targets.max()) < 50
    ids, tgt = s.train[3]
    assert torch.equal(ids[1:], tgt[:-1])


# --------------------------------------------------------------------------- registry


def test_registry_lists_builtins():
    assert {"digits", "synthetic_images", "synthetic_tokens"} <= set(list_datasets())


def test_dataset_signature_is_keyword_options_without_seed():
    sig = dataset_signature("synthetic_tokens")
    assert isinstance(sig, inspect.Signature)
    assert list(sig.parameters) == ["num_samples", "seq_len", "vocab_size", "val_samples"]
    assert sig.parameters["seq_len"].default == 64
    assert sig.parameters["seq_len"].annotation is int  # real types, not postponed strings
    assert list(dataset_signature("digits").parameters) == ["split_seed"]
    sig.bind(seq_len=8)
    with pytest.raises(TypeError):
        sig.bind(seq_lne=8)


def test_unknown_dataset_suggests_close_match():
    with pytest.raises(ValueError) as err:
        build_dataset("digit")
    msg = str(err.value)
    assert "unknown dataset 'digit'; did you mean 'digits'?" in msg and "synthetic_tokens" in msg
    with pytest.raises(ValueError, match=r"unknown dataset 'zzzz'\. Registered"):
        dataset_signature("zzzz")


def test_unknown_dataset_option_suggests_close_match():
    with pytest.raises(ValueError) as err:
        build_dataset("synthetic_images", num_sample=10)
    assert str(err.value).startswith(
        "dataset 'synthetic_images' has no option 'num_sample'; did you mean 'num_samples'? Options: "
    )
    with pytest.raises(ValueError, match="dataset 'digits' has no option 'size'. Options: split_seed"):
        build_dataset("digits", size=3)


def test_bad_dataset_values_are_named():
    with pytest.raises(ValueError, match="seq_len=0"):
        build_dataset("synthetic_tokens", seq_len=0)


def test_register_dataset_custom_and_duplicates():
    name = "_test_ramp"
    if name not in list_datasets():

        @register_dataset(name)
        def ramp(seed: int, *, n: int = 4) -> DataSplits:
            ds = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None] + seed, torch.zeros(n, dtype=torch.int64))
            return DataSplits(ds, ds, "classification", 1, [1])

    s = build_dataset(name, seed=10, n=3)
    assert len(s.train) == 3 and s.input_shape == (1,) and s.train[0][0].item() == 10.0
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(name)(lambda seed: None)
    with pytest.raises(TypeError, match="seed"):
        register_dataset("_no_seed")(lambda n=1: None)
    with pytest.raises(ValueError, match="task"):
        DataSplits(s.train, s.val, "regression", 1, (1,))


# --------------------------------------------------------------------------- loaders


def _order(loader) -> list[int]:
    return [i for (batch,) in loader for i in batch.tolist()]


def test_loader_order_reproducible_per_seed():
    ds = TensorDataset(torch.arange(100))
    a = _order(build_loader(ds, 16, shuffle=True, seed=3))
    b = _order(build_loader(ds, 16, shuffle=True, seed=3))
    c = _order(build_loader(ds, 16, shuffle=True, seed=4))
    assert a == b and a != c
    assert sorted(a) == list(range(100)) and a != list(range(100))


def test_loader_order_independent_of_global_rng():
    ds = TensorDataset(torch.arange(50))
    torch.manual_seed(0)
    a = _order(build_loader(ds, 8, shuffle=True, seed=1))
    torch.manual_seed(99)
    b = _order(build_loader(ds, 8, shuffle=True, seed=1))
    assert a == b


def test_loader_epochs_differ_but_sequence_reproducible():
    ds = TensorDataset(torch.arange(40))
    loader = build_loader(ds, 8, shuffle=True, seed=0)
    epochs = [_order(loader) for _ in range(3)]
    assert epochs[0] != epochs[1]
    again = build_loader(ds, 8, shuffle=True, seed=0)
    assert [_order(again) for _ in range(3)] == epochs


def test_loader_no_shuffle_and_drop_last():
    ds = TensorDataset(torch.arange(10))
    assert _order(build_loader(ds, 4, shuffle=False, seed=0)) == list(range(10))
    sizes = [len(b) for (b,) in build_loader(ds, 4, shuffle=False, seed=0, drop_last=True)]
    assert sizes == [4, 4]
    with pytest.raises(ValueError, match="batch_size=0"):
        build_loader(ds, 0, shuffle=False, seed=0)


def test_loader_with_workers_matches_in_process():
    ds = TensorDataset(torch.arange(30))
    a = _order(build_loader(ds, 4, shuffle=True, seed=5))
    b = _order(build_loader(ds, 4, shuffle=True, seed=5, workers=1))
    assert a == b


def test_infinite_crosses_epochs():
    ds = TensorDataset(torch.arange(10))
    loader = build_loader(ds, 4, shuffle=True, seed=0)  # 3 batches per epoch: 4, 4, 2
    items = list(itertools.islice(infinite(loader), 8))
    epochs = [e for e, _ in items]
    assert epochs == [0, 0, 0, 1, 1, 1, 2, 2]
    for epoch in (0, 1):
        seen = [i for e, (b,) in items if e == epoch for i in b.tolist()]
        assert sorted(seen) == list(range(10))  # each epoch is one full pass
    # Same as iterating the loader repeatedly with a fresh loader of the same seed.
    fresh = build_loader(ds, 4, shuffle=True, seed=0)
    expected = [b for _ in range(3) for (b,) in fresh][:8]
    assert all(torch.equal(b, e) for (_, (b,)), e in zip(items, expected))


def test_infinite_calls_sampler_set_epoch():
    class Sampler(torch.utils.data.Sampler):
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    sampler = Sampler()
    loader = torch.utils.data.DataLoader(TensorDataset(torch.arange(4)), batch_size=2, sampler=sampler)
    list(itertools.islice(infinite(loader), 5))
    assert sampler.epochs == [0, 1, 2]


def test_infinite_rejects_empty_loader():
    loader = build_loader(TensorDataset(torch.arange(3)), 4, shuffle=False, seed=0, drop_last=True)
    with pytest.raises(ValueError, match="no batches"):
        next(infinite(loader))


# --------------------------------------------------------------------------- generated text corpus


def test_text_lm_targets_are_the_next_byte_and_the_corpus_is_reproducible():
    from kiln.data import build_dataset

    a = build_dataset("text_lm", seed=0, num_samples=64, seq_len=32, val_samples=8)
    b = build_dataset("text_lm", seed=7, num_samples=64, seq_len=32, val_samples=8)  # training seed: no effect
    x, y = a.train.tensors
    assert x.shape == y.shape == (64, 32) and a.task == "lm" and a.num_classes == 256
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, b.train.tensors[0])
    assert int(x.max()) < 128  # ASCII text
    # Held-out text is a different draw of the grammar, not a slice of the training text.
    assert not torch.equal(a.val.tensors[0][:8], x[:8])
    other = build_dataset("text_lm", corpus_seed=1, num_samples=64, seq_len=32, val_samples=8)
    assert not torch.equal(other.train.tensors[0], x)
    # drawn once a process: a data set changed in place does not change the next one built
    x.zero_()
    again = build_dataset("text_lm", seed=0, num_samples=64, seq_len=32, val_samples=8).train.tensors[0]
    assert torch.equal(again, b.train.tensors[0]) and int(again.max()) > 0


def test_the_corpus_is_drawn_once_a_process_and_each_caller_gets_its_own_tensor():
    from kiln.data._text import _text_bytes, _windows, generate_text

    _text_bytes.cache_clear()
    first = _windows(3, 16, 9)
    first.fill_(0)
    second = _windows(3, 16, 9)
    assert _text_bytes.cache_info().hits == 1 and int(second.min()) > 0
    # the draw itself: the generated text, cut into windows in order
    assert bytes(second.flatten().to(torch.uint8).tolist()) == generate_text(16 * 9 // 24 + 16, 3).encode()[:16 * 9]


def test_text_mlm_scores_the_same_number_of_positions_in_every_sequence():
    from kiln.data import build_dataset
    from kiln.data._text import IGNORE_INDEX, MASK_ID, _windows

    splits = build_dataset("text_mlm", num_samples=200, seq_len=40, val_samples=8, mask_prob=0.15)
    inputs, targets = splits.train.tensors
    scored = targets != IGNORE_INDEX
    assert scored.sum(dim=1).eq(6).all()  # round(0.15 * 40)
    text = _windows(0, 200, 40)  # the corpus before masking
    assert torch.equal(inputs[~scored], text[~scored]) and torch.equal(targets[scored], text[scored])
    masked = inputs[scored] == MASK_ID
    assert 0.7 < masked.float().mean() < 0.9  # 80% of the chosen positions become [MASK]
    assert (inputs[~scored] != MASK_ID).all()
    with pytest.raises(ValueError, match="mask_prob=1.5"):
        build_dataset("text_mlm", mask_prob=1.5)
