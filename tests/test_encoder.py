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
