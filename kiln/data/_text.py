"""A small English-like text corpus generated from a grammar, for the language-model examples.

Nothing is downloaded: sentences come from a fixed vocabulary and a handful of templates,
drawn with a seeded ``random.Random``, so the same seed gives the same text on any machine.
The grammar has structure a model can learn (agreement of determiners and nouns, verbs
that take objects, fixed phrase shapes), so the loss falls well below the ~4.2 nats of
random ASCII letters.

Tokens are bytes: the text is ASCII, ids 0-127; :data:`MASK_ID` = 255 marks masked
positions for BERT-style training; the vocabulary is 256.

    >>> text = generate_text(3, seed=0)
    >>> text.count(".") >= 3 and text.isascii()
    True
"""

from __future__ import annotations

import functools
import random

import torch
from torch.utils.data import TensorDataset

from kiln.data._datasets import DataSplits, _check_positive, register_dataset

__all__ = ["generate_text", "MASK_ID", "VOCAB_SIZE", "IGNORE_INDEX"]

VOCAB_SIZE = 256  # byte-level
MASK_ID = 255  # never an ASCII byte
IGNORE_INDEX = -100  # targets that are not scored (F.cross_entropy's default ignore_index)

_NOUNS = ["cat", "dog", "river", "teacher", "garden", "engine", "city", "bird", "student", "window",
          "kiln", "potter", "market", "forest", "ship", "letter", "mountain", "farmer", "clock", "bridge"]
_ADJECTIVES = ["old", "quiet", "small", "bright", "heavy", "green", "careful", "warm", "distant", "strange"]
_TRANSITIVE = ["sees", "builds", "follows", "paints", "finds", "carries", "watches", "repairs", "visits", "answers"]
_INTRANSITIVE = ["sleeps", "waits", "sings", "turns", "rests", "shines", "falls", "listens"]
_PREPOSITIONS = ["near", "under", "behind", "beside", "across", "inside"]
_ADVERBS = ["slowly", "today", "again", "at night", "in the morning", "without a sound"]


def _noun_phrase(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    words = [rng.choice(_ADJECTIVES)] if rng.random() < 0.5 else []
    first = (words or [noun])[0]
    article = rng.choice(["the", "an" if first[0] in "aeiou" else "a", "every", "that"])
    return " ".join([article, *words, noun])


def _sentence(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    shape = rng.random()
    if shape < 0.45:
        body = f"{subject} {rng.choice(_TRANSITIVE)} {_noun_phrase(rng)}"
    elif shape < 0.75:
        body = f"{subject} {rng.choice(_INTRANSITIVE)} {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng)}"
    else:
        body = f"{subject} {rng.choice(_INTRANSITIVE)} {rng.choice(_ADVERBS)}"
    return body[0].upper() + body[1:] + "."


def generate_text(sentences: int, seed: int) -> str:
    """``sentences`` sentences of the grammar joined by spaces, reproducible from ``seed``."""
    rng = random.Random(seed)
    return " ".join(_sentence(rng) for _ in range(sentences))


def _windows(seed: int, count: int, length: int) -> torch.Tensor:
    """``count`` consecutive non-overlapping windows of ``length`` byte ids: (count, length) int64,
    a new tensor of each call (the caller may change it)."""
    ids = torch.frombuffer(bytearray(_text_bytes(seed, count * length)), dtype=torch.uint8).to(torch.int64)
    return ids.view(count, length)


@functools.lru_cache(maxsize=16)
def _text_bytes(seed: int, needed: int) -> bytes:
    """The first ``needed`` bytes of the text drawn from ``seed``, drawn once a process for each
    argument (drawing it is slow Python: docs/lab/facts.md, 'Host time'), so that a process that
    trains again, as kiln tune's trials and a test's runs do, draws it once. Kept as bytes, not a
    tensor: a run's tensor memory (summary.json, kiln plan's check against the allocator) holds
    nothing of the cache."""
    # A sentence is about 30 bytes; draw enough text in one go, then cut it to length.
    text = generate_text(needed // 24 + 16, seed).encode("ascii")
    while len(text) < needed:
        text += b" " + generate_text(needed // 24 + 16, seed + len(text)).encode("ascii")
    return text[:needed]


# Train and validation text come from different grammar draws; fixed offsets keep them apart
# whatever the training seed.
_VAL_SEED_OFFSET = 1_000_003


@register_dataset("text_lm")
def text_lm(seed: int, *, num_samples: int = 4096, seq_len: int = 64, val_samples: int = 256,
            corpus_seed: int = 0) -> DataSplits:
    """Next-byte prediction on the generated corpus: samples ``(ids, targets)``, both
    ``(seq_len,)`` int64, ``targets[t] == ids[t + 1]``.

    The text depends on ``corpus_seed`` only, not on the training ``seed``.
    """
    del seed
    _check_positive("text_lm", num_samples=num_samples, seq_len=seq_len, val_samples=val_samples)
    splits = []
    for count, offset in ((num_samples, 0), (val_samples, _VAL_SEED_OFFSET)):
        windows = _windows(corpus_seed + offset, count, seq_len + 1)  # (N, T + 1)
        splits.append(TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return DataSplits(train=splits[0], val=splits[1], task="lm", num_classes=VOCAB_SIZE, input_shape=(seq_len,))


def mask_tokens(ids: torch.Tensor, mask_prob: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking on ids (N, T): choose ``k = max(1, round(mask_prob * T))`` positions of every
    sequence; of those 80% become [MASK], 10% a random byte, 10% stay. Returns ``(inputs,
    targets)``; targets are the original ids at chosen positions and :data:`IGNORE_INDEX` elsewhere.

    Every sequence has exactly ``k`` scored positions (BERT's ``max_predictions_per_seq``, made
    exact), so every sample weighs the same in the mean loss and the mean of per-rank means
    equals the one-process mean whatever the parallel layout.

    >>> inputs, targets = mask_tokens(torch.full((4, 100), 97), 0.15, torch.Generator().manual_seed(0))
    >>> (targets != IGNORE_INDEX).sum(dim=1).tolist(), bool((inputs[targets == IGNORE_INDEX] == 97).all())
    ([15, 15, 15, 15], True)
    """
    N, T = ids.shape
    k = max(1, round(mask_prob * T))
    order = torch.rand(ids.shape, generator=generator).argsort(dim=1)  # a random permutation per row
    chosen = torch.zeros(ids.shape, dtype=torch.bool).scatter_(1, order[:, :k], True)
    roll = torch.rand(ids.shape, generator=generator)
    random_bytes = torch.randint(32, 127, ids.shape, generator=generator)  # printable ASCII
    inputs = torch.where(chosen & (roll < 0.8), MASK_ID, ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_bytes, inputs)
    targets = torch.where(chosen, ids, IGNORE_INDEX)
    return inputs, targets


@register_dataset("text_mlm")
def text_mlm(seed: int, *, num_samples: int = 4096, seq_len: int = 64, val_samples: int = 256,
             mask_prob: float = 0.15, corpus_seed: int = 0) -> DataSplits:
    """Masked-byte prediction on the generated corpus (BERT's objective): samples
    ``(inputs, targets)``, both ``(seq_len,)`` int64; see :func:`mask_tokens`.

    The masks are drawn once, from ``corpus_seed`` (static masking, as the original BERT), so
    every run and every layout sees the same masked inputs.
    """
    del seed
    _check_positive("text_mlm", num_samples=num_samples, seq_len=seq_len, val_samples=val_samples)
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"dataset 'text_mlm': mask_prob={mask_prob!r} must be in (0, 1)")
    g = torch.Generator().manual_seed(corpus_seed)
    splits = []
    for count, offset in ((num_samples, 0), (val_samples, _VAL_SEED_OFFSET)):
        inputs, targets = mask_tokens(_windows(corpus_seed + offset, count, seq_len), mask_prob, g)
        splits.append(TensorDataset(inputs, targets))
    return DataSplits(train=splits[0], val=splits[1], task="mlm", num_classes=VOCAB_SIZE, input_shape=(seq_len,))
