"""A fused pre-norm transformer encoder layer, a drop-in for ``nn.TransformerEncoderLayer(norm_first=True)``.

Shapes: B batch, T sequence, C model width (``hidden``), F feed-forward width (``ffn``),
H heads, Dh = C / H head width. ``batch_first=True`` takes (B, T, C); ``False`` takes the
seq-first layout (T, B, C) of fairseq and pycls.

What is fused compared with ``nn.TransformerEncoderLayer``:

- one ``Linear(C, 3C)`` for q, k and v (torch's layer also has one in-projection, but its
  training path goes through ``F.multi_head_attention_forward``'s chain of reshapes);
- ``F.scaled_dot_product_attention``, which on CPU runs a flash kernel and never stores the
  (B, H, T, T) attention matrix;
- optionally ``fast_dropout=True``: dropout masks from 16 random bits per element instead of
  one float draw per element (see :func:`fast_dropout`). CPU random-number generation, not
  arithmetic, dominates this layer's forward at dropout 0.1
  (docs/lab/facts.md, 'The contiguous-params article's encoder layer').

The layer is not in the model registry: the registry holds classifiers (``num_classes``,
``(B, num_classes)`` logits), and one layer maps (B, T, C) to (B, T, C). :class:`EncoderStack`
puts ``depth`` of them in ``.blocks`` with a pooled linear head, for benchmarks.

    >>> layer = EncoderLayer(EncoderLayerConfig(hidden=32, ffn=64, heads=4, dropout=0.0))
    >>> ref = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    >>> layer.load_torch_layer(ref)
    >>> x = torch.randn(2, 5, 32)  # (B, T, C)
    >>> torch.allclose(layer(x), ref(x), atol=1e-5)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["EncoderLayerConfig", "EncoderLayer", "EncoderStack", "fast_dropout", "random_bits16"]

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}

# Dropout from 16-bit lanes: an element is dropped when its lane (a uniform int16) is below
# a threshold, so the drop probability is round(p * 2**16) / 2**16, within 2**-17 of p
# (for p = 0.1 it is 0.1000061). The kept values are scaled by 1 / (1 - that probability),
# so the expectation is preserved exactly, as in F.dropout.
_LANES = 2**16


def _drop_threshold(p: float) -> tuple[int, float]:
    """(int16 threshold, scale) for drop probability ``p``: keep where ``lane >= threshold``."""
    dropped = round(p * _LANES)
    return -(2**15) + dropped, _LANES / (_LANES - dropped)


def random_bits16(numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``numel`` uniform random int16 values, drawn from torch's default generator (see
    :func:`kiln.models._bits.random_bits16`, kept out of ``torch.compile`` graphs).

    >>> random_bits16(6).dtype, random_bits16(6).shape
    (torch.int16, torch.Size([6]))
    """
    # Imported on first use: marking a function as not compilable imports torch._dynamo, which
    # `import kiln.models` must not pay (docs/lab/facts.md, 'What an import costs').
    from kiln.models._bits import random_bits16 as draw

    return draw(numel, device)


def fast_dropout(x: torch.Tensor, p: float, training: bool = True, bits: torch.Tensor | None = None) -> torch.Tensor:
    """Inverted dropout with drop probability ``p`` (to within 2**-17), 4x fewer random draws.

    ``bits`` (int16, ``x.numel()`` values, e.g. a slice of :func:`random_bits16`) lets a
    caller draw the bits for several dropouts at once.

    >>> x = torch.ones(100_000)
    >>> y = fast_dropout(x, 0.1)
    >>> abs((y == 0).float().mean().item() - 0.1) < 0.005, round(y.max().item(), 4)
    (True, 1.1111)
    """
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"fast_dropout: p={p!r} must be in [0, 1)")
    if bits is None:
        bits = random_bits16(x.numel(), x.device)
    threshold, scale = _drop_threshold(p)
    keep = bits.view(x.shape) >= threshold
    # where() rather than x * mask: autograd saves only the bool mask, and no 0 * inf = nan.
    return torch.where(keep, x * scale, 0.0)


@dataclass
class EncoderLayerConfig:
    hidden: int = 128  # model width C
    ffn: int = 512  # feed-forward width F
    heads: int = 16  # attention heads H; must divide hidden
    dropout: float = 0.1  # on attention probabilities, attention output, FFN activation and FFN output
    batch_first: bool = True  # True: (B, T, C); False: (T, B, C)
    activation: str = "relu"  # "relu" (nn.TransformerEncoderLayer's default) or "gelu"
    norm_eps: float = 1e-5  # LayerNorm epsilon, as in nn.TransformerEncoderLayer
    fast_dropout: bool = False  # dropout masks from 16-bit lanes (see fast_dropout); same p, 4x fewer draws

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EncoderLayerConfig.{name}={value!r}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"EncoderLayerConfig.heads={self.heads} does not divide hidden={self.hidden}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"EncoderLayerConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"EncoderLayerConfig.activation={self.activation!r}: use one of {', '.join(map(repr, _ACTIVATIONS))}"
            )


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: ``x + drop(attn(ln1(x)))``, then ``x + drop(fc2(drop(act(fc1(ln2(x))))))``.

    Same computation and dropout placement as ``nn.TransformerEncoderLayer(norm_first=True)``;
    :meth:`load_torch_layer` copies that layer's weights in.
    """

    def __init__(self, cfg: EncoderLayerConfig | None = None) -> None:
        super().__init__()
        cfg = cfg if cfg is not None else EncoderLayerConfig()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)  # rows: q, then k, then v (torch's in_proj order)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self._act = _ACTIVATIONS[cfg.activation]

    @torch.no_grad()
    def load_torch_layer(self, layer: nn.TransformerEncoderLayer) -> None:
        """Copy the weights of ``nn.TransformerEncoderLayer(norm_first=True)`` into this layer."""
        if not getattr(layer, "norm_first", False):
            raise ValueError("load_torch_layer: the source layer must be built with norm_first=True (pre-norm)")
        attn = layer.self_attn
        if attn.in_proj_weight is None or attn.in_proj_bias is None:
            raise ValueError("load_torch_layer: the source attention must have a packed in_proj with bias")
        self.qkv.weight.copy_(attn.in_proj_weight)
        self.qkv.bias.copy_(attn.in_proj_bias)
        pairs = [(self.proj, attn.out_proj), (self.fc1, layer.linear1), (self.fc2, layer.linear2),
                 (self.norm1, layer.norm1), (self.norm2, layer.norm2)]
        for mine, theirs in pairs:
            if mine.weight.shape != theirs.weight.shape:
                raise ValueError(f"load_torch_layer: shape {tuple(theirs.weight.shape)} does not fit "
                                 f"{tuple(mine.weight.shape)}; build the EncoderLayerConfig with the same sizes")
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)

    @classmethod
    def from_torch_layer(cls, layer: nn.TransformerEncoderLayer, **overrides) -> "EncoderLayer":
        """A new :class:`EncoderLayer` with the sizes and weights of ``layer``, on its device and in its
        dtype (``overrides`` go to the config)."""
        cfg = EncoderLayerConfig(
            hidden=layer.linear1.in_features, ffn=layer.linear1.out_features, heads=layer.self_attn.num_heads,
            dropout=layer.dropout.p, batch_first=layer.self_attn.batch_first, norm_eps=layer.norm1.eps,
        )
        for key, value in overrides.items():
            setattr(cfg, key, value)
        cfg.__post_init__()
        weight = layer.linear1.weight
        new = cls(cfg).to(weight.device, weight.dtype)  # where layer is, as layer is
        new.load_torch_layer(layer)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.cfg.dropout if self.training else 0.0
        if p > 0.0 and self.cfg.fast_dropout:
            # Draw the bits of all four dropouts in one call: one generator round trip, and
            # one graph break under torch.compile instead of four.
            sizes = self._dropout_sizes(x)
            bits = random_bits16(sum(sizes), x.device).split(sizes)
            return self._forward_fast(x, p, bits)
        return self._forward(x, p)

    def _forward_fast(self, x: torch.Tensor, p: float, bits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The forward with :func:`fast_dropout`'s masks, in as few passes over memory as the math allows.

        Each dropout ``drop(z) = where(keep, z, 0) * s`` (s = 1 / (1 - p)) is one ``where`` here:
        its scale s moves into a weight, thousands of elements instead of the activation's
        millions. ``proj(drop(P) V) = proj`` with weight W s; ``fc2(drop(h))`` likewise; and the
        dropout on ``proj``'s and ``fc2``'s outputs scales their weight and bias by s once more.
        On CPU a pass over the (B, H, T, T) attention probabilities (50 x 16 x 80 x 80 = 5.1 M
        floats in ``kiln bench encoder-layer``) costs about as much as the matmul that makes
        them: this saves one such pass in forward and one in backward per dropout, beside the
        random draws :func:`random_bits16` already saves. The result equals the spelled-out
        dropouts to rounding, gradients included (tests/test_encoder.py).
        """
        threshold, s = _drop_threshold(p)
        H, C = self.cfg.heads, x.shape[-1]
        # ---- attention: x + drop(proj(drop(softmax(q k^T / sqrt(Dh))) v))
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, H, C // H))  # (B, T, 3, H, Dh) or (T, B, 3, H, Dh)
        order = (2, 0, 3, 1, 4) if self.cfg.batch_first else (2, 1, 3, 0, 4)
        # one copy into (3, B, H, T, Dh): the batched matmuls then read q, k (transposed) and v
        # in place, where strided views would each be copied, forward and backward
        q, k, v = qkv.permute(order).contiguous().unbind(0)  # each (B, H, T, Dh)
        scores = (q * (q.shape[-1] ** -0.5)) @ k.transpose(-2, -1)  # (B, H, T, T)
        keep = bits[0].view(scores.shape) >= threshold
        y = torch.where(keep, scores.softmax(dim=-1), 0.0) @ v  # (B, H, T, Dh), not yet scaled by s
        back = (0, 2, 1, 3) if self.cfg.batch_first else (2, 0, 1, 3)
        y = y.permute(back).flatten(-2)  # (B, T, C) or (T, B, C)
        # s * s: the attention dropout's scale and the residual dropout's, b * s: the latter's
        a = F.linear(y, self.proj.weight * (s * s), self.proj.bias * s)
        x = x + torch.where(bits[1].view(x.shape) >= threshold, a, 0.0)
        # ---- feed-forward: x + drop(fc2(drop(act(fc1(ln2(x))))))
        h = self._act(self.fc1(self.norm2(x)))  # (..., F)
        h = torch.where(bits[2].view(h.shape) >= threshold, h, 0.0)
        out = F.linear(h, self.fc2.weight * (s * s), self.fc2.bias * s)
        return x + torch.where(bits[3].view(x.shape) >= threshold, out, 0.0)

    def _dropout_sizes(self, x: torch.Tensor) -> list[int]:
        tokens = x.shape[0] * x.shape[1]
        T = x.shape[1] if self.cfg.batch_first else x.shape[0]
        attn_probs = tokens * self.cfg.heads * T  # (B, H, T, T)
        return [attn_probs, tokens * self.cfg.hidden, tokens * self.cfg.ffn, tokens * self.cfg.hidden]

    def _forward(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """The forward with ``F.dropout`` (or none: p = 0, eval)."""
        drop = (lambda z: F.dropout(z, p)) if p > 0.0 else (lambda z: z)
        x = x + drop(self._attention(self.norm1(x), p))
        h = drop(self._act(self.fc1(self.norm2(x))))  # (..., F)
        return x + drop(self.fc2(h))

    def _attention(self, h: torch.Tensor, p: float) -> torch.Tensor:
        H = self.cfg.heads
        C = h.shape[-1]
        qkv = self.qkv(h).unflatten(-1, (3, H, C // H))  # (B, T, 3, H, Dh) or (T, B, 3, H, Dh)
        # Both layouts become (3, B, H, T, Dh) views; SDPA takes strided inputs, so no copy here.
        order = (2, 0, 3, 1, 4) if self.cfg.batch_first else (2, 1, 3, 0, 4)
        q, k, v = qkv.permute(order).unbind(0)  # each (B, H, T, Dh)
        # F.scaled_dot_product_attention applies dropout whenever dropout_p > 0, even in eval.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, T, Dh)
        back = (0, 2, 1, 3) if self.cfg.batch_first else (2, 0, 1, 3)
        y = y.permute(back).flatten(-2)  # (B, T, C) or (T, B, C)
        return self.proj(y)


class EncoderStack(nn.Module):
    """``depth`` encoder layers in ``.blocks``, a final LayerNorm and a mean-pooled linear head.

    Maps (B, T, C) (or (T, B, C) with ``batch_first=False``) to (B, out_features). Used by
    ``kiln bench memory`` as a transformer whose blocks activation checkpointing can wrap.

    >>> model = EncoderStack(EncoderLayerConfig(hidden=32, ffn=64, heads=4), depth=2, out_features=3)
    >>> model(torch.randn(5, 7, 32)).shape
    torch.Size([5, 3])
    """

    def __init__(self, cfg: EncoderLayerConfig | None = None, depth: int = 12, out_features: int = 10) -> None:
        super().__init__()
        cfg = cfg if cfg is not None else EncoderLayerConfig()
        self.cfg = cfg
        self.blocks = nn.ModuleList(EncoderLayer(cfg) for _ in range(depth))
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        pooled = self.norm(x).mean(dim=1 if self.cfg.batch_first else 0)  # (B, C)
        return self.head(pooled)
