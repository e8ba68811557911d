"""Random bits for kiln's fast dropout, drawn outside ``torch.compile`` graphs."""

from __future__ import annotations

import torch


@torch.compiler.disable
def random_bits16(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``numel`` uniform random int16 values, drawn from torch's default generator.

    One 64-bit draw gives four lanes, so this asks the generator for a quarter as many
    numbers as ``torch.rand`` would: on CPU, where the generator is serial, a quarter of the
    work that dominates dropout (docs/lab/facts.md, 'The contiguous-params article's encoder layer').
    Because the bits come from torch's generator, ``torch.manual_seed`` makes them
    reproducible and activation checkpointing (``preserve_rng_state``) redraws the same ones.
    Kept out of ``torch.compile`` graphs: inductor would otherwise lower ``random_`` to its
    own per-element Philox, which is slower on CPU.

    >>> random_bits16(6).dtype, random_bits16(6).shape
    (torch.int16, torch.Size([6]))
    """
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), None)  # the full 64-bit range: every bit uniform
    return words.view(torch.int16)[:numel]
