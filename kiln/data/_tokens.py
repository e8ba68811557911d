"""``data.name=tokens``: token files as nanoGPT writes them, read through a memmap, or, with no
file, a generated token stream, so that a language-model config runs with no download.

A token file is a flat array of token ids with no header: nanoGPT's ``prepare.py`` writes
``np.array(ids, dtype=np.uint16).tofile("train.bin")``. The file cannot say its dtype, so
``dtype`` does: by default uint16 where the vocabulary fits 16 bits (at most 65,536 ids;
GPT-2's 50,257) and uint32 above it (Llama 3's 128,256); set it for a uint32 file of a small
vocabulary.

Samples are windows of ``seq_len + 1`` tokens cut with stride ``seq_len``: window ``i`` is
tokens ``[i*T, i*T + T + 1)``, its inputs ``window[:-1]`` and targets ``window[1:]``, both
``(T,)`` int64. Consecutive windows share one token, so every token but the first is a target
exactly once an epoch. nanoGPT samples random offsets instead; fixed windows make a map-style
data set of fixed length, which kiln's StepSampler shuffles per epoch and a resume, in any
layout, replays exactly.

Validation: the first ``val_samples`` windows of ``val_path``; without it, the last
``val_samples`` windows of ``path``, which training then never sees (its windows stop before
them). Without a path both come from the generated stream (:func:`token_stream`).

    >>> splits = tokens(0, seq_len=8, vocab_size=1000, num_samples=16, val_samples=4)
    >>> inputs, targets = splits.train[0]
    >>> inputs.shape, bool((inputs[1:] == targets[:-1]).all()), len(splits.train), len(splits.val)
    (torch.Size([8]), True, 16, 4)
"""

from __future__ import annotations

import functools
import os
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from kiln import _cache
from kiln.data._datasets import DataSplits, register_dataset
from kiln.errors import ConfigError

__all__ = ["TokenWindows", "token_stream", "tokens"]

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_GENERATED_SAMPLES = 2048  # training windows of the generated stream when num_samples is None
_VAL_SAMPLES = 256  # validation windows when val_samples is not given
_VAL_SEED_OFFSET = 1_000_003  # the generated validation path's seed: apart from the training one's
_CHUNK = 1 << 24  # ids per block of the scan for the largest id (32 MiB of uint16)


class TokenWindows(Dataset):
    """``count`` windows of ``seq_len + 1`` tokens with stride ``seq_len``, the first starting at
    token ``start`` of ``tokens``: a token file's path (read through a memmap) or an array.
    Item ``i`` is ``(inputs, targets)``, both ``(seq_len,)`` int64, ``targets[t] == inputs[t + 1]``.

    A file is mapped on first use in each process, never read whole, and the mapping is not
    pickled: a loader worker gets the path and maps the file itself.
    """

    def __init__(self, tokens: str | np.ndarray, *, dtype: str, start: int, count: int, seq_len: int) -> None:
        self.path = tokens if isinstance(tokens, str) else None
        self.dtype, self.start, self.count, self.seq_len = dtype, start, count, seq_len
        self._tokens = None if self.path is not None else tokens

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.count <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=_DTYPES[self.dtype], mode="r")
        first = self.start + (index % self.count) * self.seq_len
        # astype copies the window out of the mapping (or the shared generated array) into int64
        window = torch.from_numpy(self._tokens[first:first + self.seq_len + 1].astype(np.int64))  # (T + 1,)
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.path is not None:
            state["_tokens"] = None  # a worker maps the file again rather than receive the mapping
        return state


# --------------------------------------------------------------------------- the generated stream

_SUCCESSORS = 4  # each token is followed by one of 4 tokens of its own ...
_CHOICE = (0.6, 0.85, 0.95)  # ... with probabilities 0.6, 0.25, 0.1, 0.05 (cumulative here)
_CHAIN = 2048  # tokens of one chain ("document") before the stream starts another


@functools.lru_cache(maxsize=8)
def token_stream(vocab_size: int, n_tokens: int, seed: int, corpus_seed: int = 0) -> np.ndarray:
    """``n_tokens`` ids in ``[0, vocab_size)`` from a Markov chain, reproducible from the seeds:
    ``corpus_seed`` draws the chain (which tokens follow which), ``seed`` the walk through it.

    Each token has 4 successors drawn from a Zipf-like law over the ids, taken with
    probabilities 0.6, 0.25, 0.1 and 0.05, so there is structure to learn: the loss falls from
    ln(V) through the unigram frequencies towards the choice's entropy of 1.03 nats. The walk
    is made as chains of 2,048 tokens stepped side by side (4 M tokens in about half a second).
    Kept as a read-only numpy array (uint16 or uint32), not a tensor, so that a run's tensor
    memory holds nothing of it; cached, so that a process that plans and trains draws it once.

    >>> ids = token_stream(50304, 10_000, seed=1)
    >>> ids.dtype, int(ids.max()) < 50304, bool((ids == token_stream(50304, 10_000, seed=1)).all())
    (dtype('uint16'), True, True)
    """
    g = torch.Generator().manual_seed(corpus_seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64) ** 1.1  # (V,)
    successors = torch.multinomial(zipf, vocab_size * _SUCCESSORS, replacement=True, generator=g)  # (V * 4,)
    g = torch.Generator().manual_seed(seed)
    length = min(n_tokens, _CHAIN)
    chains = -(-n_tokens // length)
    choice = torch.searchsorted(torch.tensor(_CHOICE), torch.rand(length, chains, generator=g))  # (L, R)
    state = torch.multinomial(zipf, chains, replacement=True, generator=g)  # (R,)
    walk = torch.empty(length, chains, dtype=torch.int64)  # (L, R): column r is chain r
    for t in range(length):  # one step of every chain at once: L steps, not n_tokens
        walk[t] = state
        state = successors[state * _SUCCESSORS + choice[t]]
    ids = walk.t().reshape(-1)[:n_tokens].numpy().astype(_DTYPES[_default_dtype(vocab_size)])
    ids.flags.writeable = False  # shared by every caller of the cache
    return ids


# --------------------------------------------------------------------------- token files


def _default_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _largest_id(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    """The largest id in the file, scanned in blocks (a file may be many GB) once per version of
    the file: kiln's cache (:mod:`kiln._cache`) keeps it by path, size and modification time,
    since every process of a run checks its config again."""
    key = f"{path}|{size}|{mtime_ns}|{dtype}"
    hit = _cache.get("token_files", key)
    if hit is None:
        tokens = np.memmap(path, dtype=_DTYPES[dtype], mode="r")
        hit = max(int(tokens[i:i + _CHUNK].max()) for i in range(0, len(tokens), _CHUNK))
        _cache.put("token_files", key, hit)
    return hit


def _check_file(path: str, key: str, *, dtype: str, vocab_size: int, needed: int, what: str) -> int:
    """The number of tokens in token file ``path`` (named ``key`` in errors), after checking that
    it holds whole ``dtype`` ids, at least ``needed`` of them (``what`` says for what) and no id
    outside the vocabulary. Raises ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path}: no such file; give a token file (nanoGPT's train.bin), or no "
                          "data.path for the generated token stream")
    stat = os.stat(path)
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    if stat.st_size == 0:
        raise ConfigError(f"{key}={path} is empty; give a token file that holds the tokenized text")
    if stat.st_size % itemsize:
        raise ConfigError(f"{key}={path} is {stat.st_size:,} bytes, not a whole number of {dtype} ids ({itemsize} "
                          f"bytes each): not a token file, or not {dtype}; set data.args.dtype to the dtype it "
                          "was written in")
    n_tokens = stat.st_size // itemsize
    if n_tokens < needed:
        raise ConfigError(f"{key}={path} holds {n_tokens:,} tokens, fewer than the {needed:,} of {what}")
    if dtype == "uint16" and n_tokens >= 2048:
        # uint32 ids below 65,536 read as uint16 are each id followed by a 0, every one in range:
        # nothing else would stop a run training on them
        head = np.memmap(path, dtype=np.uint16, mode="r")[:1 << 16]
        if not head[1::2].any() and head[0::2].any():
            raise ConfigError(f"{key}={path}: every second uint16 id is 0, as in a file of uint32 ids; "
                              "set data.args.dtype=uint32")
    top = _largest_id(os.path.realpath(path), dtype, stat.st_size, stat.st_mtime_ns)
    if top >= vocab_size:
        raise ConfigError(f"{key}={path} holds token id {top:,}, beyond the vocabulary of {vocab_size:,} (ids 0 to "
                          f"{vocab_size - 1:,}); tokenize with the model's tokenizer, or give a model whose "
                          f"vocab_size exceeds {top:,}")
    return n_tokens


def _check_args(args: dict[str, Any], *, path: str | None, val_path: str | None,
                model: dict[str, Any]) -> dict[str, Any]:
    """``data.args`` of ``tokens`` completed from the model and checked, files included, before
    anything is built: ``seq_len`` and ``vocab_size`` default to the model's (``model``: the
    sizes of a kiln model; empty for another, which must then be given them), ``dtype`` to the
    vocabulary's. Raises ConfigError naming the key."""
    args = dict(args)
    for key, meaning in (("seq_len", "the model's context length"), ("vocab_size", "the model's vocabulary size")):
        given, known = args.get(key), model.get(key)
        if given is None and known is None:
            raise ConfigError(f"data.args.{key} is missing: data.name=tokens takes it from a kiln model "
                              f"(model.name), and this model does not say it; set data.args.{key} to {meaning}")
        if given is not None and known is not None and given > known:
            raise ConfigError(f"data.args.{key}={given} exceeds model.{key}={known}; lower data.args.{key}, or "
                              f"leave it unset to take the model's")
        args[key] = known if given is None else given
    if args.get("dtype") is None:
        args["dtype"] = _default_dtype(args["vocab_size"])
    _splits(args, path, val_path, build=False)
    return args


def _positive(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"data.args.{key}={value!r} must be a positive integer")


def _splits(args: dict[str, Any], path: str | None, val_path: str | None, *, build: bool) -> DataSplits | None:
    """Check ``args`` and the files, and with ``build`` make the splits (without, only check:
    nothing is generated and no file is mapped)."""
    seq_len, vocab_size, dtype = args["seq_len"], args["vocab_size"], args["dtype"]
    num_samples, val_samples = args.get("num_samples"), args.get("val_samples", _VAL_SAMPLES)
    for key in ("seq_len", "vocab_size", "num_samples", "val_samples"):
        _positive(key, args.get(key))
    if vocab_size > 1 << 16 and dtype == "uint16":
        raise ConfigError(f"data.args.dtype=uint16 holds ids below 65,536, and the vocabulary is {vocab_size:,}; "
                          "set data.args.dtype=uint32 (or leave it unset: the vocabulary decides)")
    splits: dict[str, Any] = {}
    if path is None:
        if val_path is not None:
            raise ConfigError("data.val_path is set without data.path: give data.path (the training tokens) too, "
                              "or neither for the generated stream")
        count = num_samples or _GENERATED_SAMPLES
        if build:
            corpus_seed = args.get("corpus_seed", 0)
            for name, windows, seed in (("train", count, corpus_seed), ("val", val_samples, corpus_seed + _VAL_SEED_OFFSET)):
                stream = token_stream(vocab_size, windows * seq_len + 1, seed, corpus_seed)
                splits[name] = TokenWindows(stream, dtype=_default_dtype(vocab_size), start=0, count=windows,
                                            seq_len=seq_len)
    else:
        if args.get("corpus_seed", 0) != 0:
            raise ConfigError("data.args.corpus_seed seeds the generated stream, which data.path replaces; "
                              "remove data.args.corpus_seed")
        train_needed = (num_samples or 1) * seq_len + 1
        train_what = (f"data.args.num_samples={num_samples} windows" if num_samples else "one window")
        train_what += f" of data.args.seq_len={seq_len} (+ 1)"
        if val_path is not None:
            n_val = _check_file(val_path, "data.val_path", dtype=dtype, vocab_size=vocab_size, needed=seq_len + 1,
                                what=f"one window of data.args.seq_len={seq_len} (+ 1); give a longer file, or "
                                     "lower data.args.seq_len")
            val = (val_path, 0, min(val_samples, (n_val - 1) // seq_len))
            n_train = _check_file(path, "data.path", dtype=dtype, vocab_size=vocab_size, needed=train_needed,
                                  what=f"{train_what}; give a longer file, or lower data.args.seq_len"
                                       + (" or data.args.num_samples" if num_samples else ""))
        else:
            # the file's last val_samples windows are held out, and training stops before them
            held_out = val_samples * seq_len + 1
            n_total = _check_file(path, "data.path", dtype=dtype, vocab_size=vocab_size,
                                  needed=train_needed + held_out,
                                  what=f"{train_what} and the data.args.val_samples={val_samples} validation "
                                       "windows held out at its end; give data.val_path, or lower "
                                       "data.args.val_samples")
            n_train = n_total - held_out
            val = (path, n_train, val_samples)
        if build:
            count = num_samples or (n_train - 1) // seq_len
            splits["train"] = TokenWindows(path, dtype=dtype, start=0, count=count, seq_len=seq_len)
            splits["val"] = TokenWindows(val[0], dtype=dtype, start=val[1], count=val[2], seq_len=seq_len)
    if not build:
        return None
    return DataSplits(train=splits["train"], val=splits["val"], task="lm", num_classes=vocab_size,
                      input_shape=(seq_len,))


@register_dataset("tokens", check=_check_args)
def tokens(seed: int, *, path: Optional[str] = None, val_path: Optional[str] = None, seq_len: Optional[int] = None,
           vocab_size: Optional[int] = None, dtype: Optional[Literal["uint16", "uint32"]] = None,
           num_samples: Optional[int] = None, val_samples: int = _VAL_SAMPLES, corpus_seed: int = 0) -> DataSplits:
    """Next-token prediction on windows of a token file (``path``; validation ``val_path``, else
    the file's tail) or of the generated stream. A config names the files by the top-level keys
    ``data.path`` and ``data.val_path``, and takes ``seq_len`` and ``vocab_size`` from a kiln
    model; called directly, give both.

    ``num_samples``: training windows (None: every window of the file; 2,048 generated ones);
    ``val_samples``: validation windows (fewer where ``val_path`` holds fewer); ``dtype``: the
    file's ids (None: uint16 up to 65,536 ids, else uint32); ``corpus_seed``: the generated
    stream's. The training ``seed`` changes nothing: the data are the same in every run.
    """
    del seed
    args = {"seq_len": seq_len, "vocab_size": vocab_size, "dtype": dtype, "num_samples": num_samples,
            "val_samples": val_samples, "corpus_seed": corpus_seed}
    args = _check_args(args, path=path, val_path=val_path, model={})
    return _splits(args, path, val_path, build=True)

