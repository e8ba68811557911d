"""Tests for kiln.models.encoder: the fused layer computes what nn.TransformerEncoderLayer computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.memory import apply_ac
from kiln.models.encoder import EncoderLayer, EncoderLayerConfig, EncoderStack, fast_dropout, random_bits16

HIDDEN, FFN, HEADS = 128, 512, 16


def _pair(batch_first: bool, **overrides) -> tuple[EncoderLayer, nn.TransformerEncoderLayer]:
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(d_model=HIDDEN, nhead=HEADS, dim_feedforward=FFN, dropout=0.0,
                                     batch_first=batch_first, norm_first=True)
    # Non-trivial norms and biases, so a swapped or missed copy cannot pass.
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return EncoderLayer.from_torch_layer(ref, **overrides), ref


@pytest.mark.parametrize("batch_first", [True, False], ids=["BTC", "TBC"])
def test_matches_torch_layer_outputs_and_gradients(batch_first):
    mine, ref = _pair(batch_first)
    assert mine.cfg.batch_first is batch_first and mine.cfg.dropout == 0.0
    shape = (6, 10, HIDDEN) if batch_first else (10, 6, HIDDEN)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mine(x1), ref(x2)
    assert y1.shape == shape
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    (y1**2).mean().backward()
    (y2**2).mean().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    attn = ref.self_attn
    pairs = {
        "qkv.weight": attn.in_proj_weight, "qkv.bias": attn.in_proj_bias,
        "proj.weight": attn.out_proj.weight, "proj.bias": attn.out_proj.bias,
        "fc1.weight": ref.linear1.weight, "fc1.bias": ref.linear1.bias,
        "fc2.weight": ref.linear2.weight, "fc2.bias": ref.linear2.bias,
        "norm1.weight": ref.norm1.weight, "norm1.bias": ref.norm1.bias,
        "norm2.weight": ref.norm2.weight, "norm2.bias": ref.norm2.bias,
    }
    mine_params = dict(mine.named_parameters())
    assert set(mine_params) == set(pairs)
    for name, theirs in pairs.items():
        torch.testing.assert_close(mine_params[name].grad, theirs.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_layouts_agree():
    """The seq-first layer on x.transpose(0, 1) is the batch-first layer on x, transposed."""
    bf, _ = _pair(True)
    sf, _ = _pair(False)
    x = torch.randn(3, 7, HIDDEN)
    torch.testing.assert_close(sf(x.transpose(0, 1)).transpose(0, 1), bf(x), rtol=1e-5, atol=1e-5)


def test_fast_dropout_is_dropout_with_p():
    torch.manual_seed(0)
    x = torch.ones(2_000_000)
    y = fast_dropout(x, 0.1)
    dropped = (y == 0).double().mean().item()
    # Binomial std of the dropped fraction is sqrt(0.09 / 2e6) = 2.1e-4; allow 5 sigma.
    assert abs(dropped - 0.1) < 1.1e-3
    kept = y[y != 0]
    assert torch.all(kept == kept[0]) and abs(kept[0].item() - 1 / 0.9) < 1e-4
    assert abs(y.double().mean().item() - 1.0) < 2e-3  # expectation preserved
    # Backward passes gradients through the kept elements only, with the same scale.
    x = torch.randn(1000, requires_grad=True)
    y = fast_dropout(x, 0.3)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(y != 0, 1 / (1 - 0.3), 0.0), rtol=1e-4, atol=0)
    assert torch.equal(fast_dropout(x, 0.3, training=False), x)
    # The 16-bit lanes are uniform: each of the 16 bits is set half the time.
    bits = random_bits16(1_000_000).to(torch.int32) & 0xFFFF
    freq = torch.stack([((bits >> b) & 1).double().mean() for b in range(16)])
    assert torch.all((freq - 0.5).abs() < 3e-3), freq
    # Reproducible from torch's seed.
    torch.manual_seed(5)
    a = random_bits16(100)
    torch.manual_seed(5)
    assert torch.equal(a, random_bits16(100))


@pytest.mark.parametrize("fast", [False, True], ids=["torch-dropout", "fast-dropout"])
def test_dropout_layer_trains_and_eval_matches(fast):
    mine, ref = _pair(True, dropout=0.1, fast_dropout=fast)
    x = torch.randn(4, 12, HIDDEN)
    mine.eval(), ref.eval()
    torch.testing.assert_close(mine(x), ref(x), rtol=1e-5, atol=1e-5)  # no dropout in eval
    mine.train()
    torch.manual_seed(3)
    a = mine(x)
    torch.manual_seed(3)
    b = mine(x)
    assert torch.equal(a, b)  # masks come from torch's generator
    assert not torch.allclose(a, mine.eval()(x))  # and dropout is on in training


def _spelled_out(layer: EncoderLayer, x: torch.Tensor, bits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The layer's training forward written the plain way: every dropout a fast_dropout of its
    own bits, scaled where it is applied (the layer moves the scales into proj and fc2)."""
    cfg, p = layer.cfg, layer.cfg.dropout
    H, C = cfg.heads, x.shape[-1]
    order = (2, 0, 3, 1, 4) if cfg.batch_first else (2, 1, 3, 0, 4)
    q, k, v = layer.qkv(layer.norm1(x)).unflatten(-1, (3, H, C // H)).permute(order).unbind(0)
    probs = fast_dropout(((q / (C // H) ** 0.5) @ k.transpose(-2, -1)).softmax(-1), p, bits=bits[0])
    y = (probs @ v).permute((0, 2, 1, 3) if cfg.batch_first else (2, 0, 1, 3)).flatten(-2)
    x = x + fast_dropout(layer.proj(y), p, bits=bits[1])
    h = fast_dropout(torch.relu(layer.fc1(layer.norm2(x))), p, bits=bits[2])
    return x + fast_dropout(layer.fc2(h), p, bits=bits[3])


@pytest.mark.parametrize("batch_first", [True, False], ids=["BTC", "TBC"])
def test_fast_dropout_layer_is_the_spelled_out_dropout(batch_first):
    """The fused training forward (scales folded into proj and fc2, one where per dropout) is
    the layer with four fast_dropouts of the same bits: same outputs, same gradients."""
    layer, _ = _pair(batch_first, dropout=0.25, fast_dropout=True)
    shape = (4, 12, HIDDEN) if batch_first else (12, 4, HIDDEN)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(9)
    sizes = layer._dropout_sizes(x)
    bits = random_bits16(sum(sizes)).split(sizes)  # what the layer draws after the same seed
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(9)
    y1 = layer(x1)
    (y1**2).mean().backward()
    grads1 = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    y2 = _spelled_out(layer, x2, bits)
    (y2**2).mean().backward()
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for (name, p), g1 in zip(layer.named_parameters(), grads1):
        torch.testing.assert_close(g1, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    # and dropout really drops: about a quarter of the attention probabilities' positions
    keep = bits[0] >= -(2**15) + round(0.25 * 2**16)
    assert abs(1 - keep.double().mean().item() - 0.25) < 0.01
    # p = 0 in training, and eval mode, are the layer without dropout (the torch layer's path)
    layer.eval()
    ref = layer(x)
    layer.train()
    layer.cfg.dropout = 0.0
    assert torch.equal(layer(x), ref)


def test_fast_dropout_keep_rate_scale_and_mask_across_p():
    """For several p: the kept fraction is 1 - p within 5 binomial sigmas, kept values are scaled
    by 1 / (1 - p) (p rounded to 2**-16), and the gradient passes through the same mask."""
    n = 1_000_000
    for p in (0.05, 0.1, 0.5, 0.9):
        torch.manual_seed(1)
        x = torch.full((n,), 2.0, requires_grad=True)
        y = fast_dropout(x, p)
        kept = y != 0
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(kept.double().mean().item() - (1 - p)) < 5 * sigma, p
        q = round(p * 2**16) / 2**16
        torch.testing.assert_close(y[kept], torch.full_like(y[kept], 2.0 / (1 - q)))
        y.sum().backward()
        assert torch.equal(x.grad != 0, kept)
        torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - q)))
    assert fast_dropout(x, 0.0) is x and fast_dropout(x, 0.5, training=False) is x


def test_fast_dropout_layer_under_checkpoint_is_bitwise_equal():
    cfg = EncoderLayerConfig(hidden=32, ffn=64, heads=4, dropout=0.1, fast_dropout=True)
    grads = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = EncoderStack(cfg, depth=3, out_features=2)
        apply_ac(model, mode)
        torch.manual_seed(1)
        model(torch.randn(3, 9, 32)).square().mean().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["full"]))


def test_config_errors():
    with pytest.raises(ValueError, match="heads"):
        EncoderLayerConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="activation"):
        EncoderLayerConfig(activation="swish")
    ref = nn.TransformerEncoderLayer(32, 4, 64, norm_first=False)
    with pytest.raises(ValueError, match="norm_first"):
        EncoderLayer(EncoderLayerConfig(hidden=32, ffn=64, heads=4)).load_torch_layer(ref)


def test_the_benchmark_builds_transformer_big_at_hidden_1024():
    """kiln bench encoder-layer --hidden 1024: every variant is seed 000's Transformer-big layer
    (hidden 1024, FFN 4096, 16 heads: 12,596,224 parameters) from the same weights."""
    from kiln.bench.encoder_layer import _build

    variants = _build(quick=True, notes=[], hidden=1024)
    assert [v.name for v in variants] == ["a", "b", "c-fp32-eager", "c-fp32", "c-eager", "c"]
    assert {sum(p.numel() for p in v.module.parameters()) for v in variants} == {12_596_224}
    torch_layer, kiln_layer = variants[0].module.eval(), variants[2].module.eval()
    assert torch_layer.linear1.weight.shape == (4096, 1024) and torch_layer.self_attn.num_heads == 16
    x = torch.randn(2, 5, 1024, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(kiln_layer(x), torch_layer(x), rtol=1e-4, atol=1e-4)
