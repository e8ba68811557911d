"""Tests for kiln.models: every registered model gets the same checks (timm style)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import kiln.models
from kiln.models import create_model, example_input, list_models, model_config_class, register_model
from kiln.models.vit import ViTConfig

BATCH = 3


def test_builtin_models_registered():
    assert {"vit", "mlp", "gpt", "bert"} <= set(list_models())
    assert list_models() == sorted(list_models())


@pytest.mark.parametrize("name", list_models())
def test_config_is_dataclass_with_defaults(name):
    cfg_cls = model_config_class(name)
    assert dataclasses.is_dataclass(cfg_cls)
    cfg_cls()  # every field has a default


@pytest.mark.parametrize("name", list_models())
def test_forward_shape_and_finite_grads(name):
    torch.manual_seed(0)
    model = create_model(name)
    cfg = model_config_class(name)()
    x = example_input(name, BATCH, generator=torch.Generator().manual_seed(0))
    logits = model(x)
    # Classifiers give (B, num_classes); language models (B, T, vocabulary) for ids (B, T).
    per_token = not x.is_floating_point()  # token ids in, one prediction per position out
    assert logits.shape == ((*x.shape, cfg.num_classes) if per_token else (BATCH, cfg.num_classes))
    assert logits.dtype == torch.float32
    targets = torch.arange(logits[..., 0].numel()).view(logits.shape[:-1]) % cfg.num_classes
    loss = nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: {pname} has non-finite gradient"
        # Every parameter takes part in the forward pass (no dead modules).
        assert p.grad.abs().sum() > 0, f"{name}: {pname} has an all-zero gradient"


@pytest.mark.parametrize("name", list_models())
def test_blocks_is_modulelist(name):
    model = create_model(name)
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) >= 1


@pytest.mark.parametrize("name", list_models())
def test_deterministic_and_eval_equals_train_without_dropout(name):
    torch.manual_seed(0)
    model = create_model(name)  # defaults have dropout=0
    x = example_input(name, BATCH, generator=torch.Generator().manual_seed(1))
    model.train()
    y_train = model(x)
    y_train2 = model(x)
    model.eval()
    with torch.no_grad():
        y_eval = model(x)
    torch.testing.assert_close(y_train, y_train2, rtol=0, atol=0)
    torch.testing.assert_close(y_train.detach(), y_eval, rtol=0, atol=0)


@pytest.mark.parametrize("name", list_models())
def test_same_seed_same_init(name):
    torch.manual_seed(123)
    a = create_model(name)
    torch.manual_seed(123)
    b = create_model(name)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na


# --------------------------------------------------------------------------- error messages


def test_unknown_model_suggests_close_match():
    with pytest.raises(ValueError) as err:
        create_model("vti")
    msg = str(err.value)
    assert "'vti'" in msg and "did you mean 'vit'" in msg
    for name in list_models():
        assert name in msg


def test_unknown_model_without_close_match_lists_models():
    with pytest.raises(ValueError, match=r"unknown model 'zzzzzz'\. Registered models: .*vit"):
        model_config_class("zzzzzz")


def test_unknown_option_suggests_close_match():
    with pytest.raises(ValueError) as err:
        create_model("vit", dpeth=2)
    assert str(err.value).startswith("model 'vit' has no option 'dpeth'; did you mean 'depth'? Options: ")
    assert "patch_size" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(patch_size=3), ["patch_size=3", "image_size=8", "divide"]),
        (dict(dim=30, heads=4), ["heads=4", "dim=30", "divide"]),
        (dict(pool="max"), ["pool='max'", "'mean'", "'cls'"]),
        (dict(depth=0), ["depth=0", "positive"]),
        (dict(dropout=1.5), ["dropout=1.5"]),
    ],
)
def test_bad_vit_config_names_field_and_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        create_model("vit", **kwargs)
    for word in words:
        assert word in str(err.value)


def test_mlp_accepts_list_hidden_and_rejects_bad_widths():
    model = create_model("mlp", hidden=[32, 16])
    assert model.cfg.hidden == (32, 16)
    assert [b[0].out_features for b in model.blocks] == [32, 16]
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)  # images are flattened
    with pytest.raises(ValueError, match=r"hidden\[1\]=0"):
        create_model("mlp", hidden=[32, 0])
    with pytest.raises(ValueError, match="list of widths"):
        create_model("mlp", hidden=32)
    with pytest.raises(ValueError, match=r"got input \(2, 3, 8, 8\).*in_features=192"):
        create_model("mlp")(torch.randn(2, 3, 8, 8))


def test_register_model_rejects_duplicates_and_bad_configs():
    with pytest.raises(ValueError, match="already registered"):
        register_model("vit", ViTConfig)(lambda cfg: nn.Identity())
    with pytest.raises(TypeError, match="dataclass"):
        register_model("_not_a_dataclass", dict)

    @dataclasses.dataclass
    class NoDefault:
        width: int

    with pytest.raises(TypeError, match="width"):
        register_model("_no_default", NoDefault)
    assert "_not_a_dataclass" not in list_models() and "_no_default" not in list_models()


# --------------------------------------------------------------------------- ViT numerics


def _permute_patches(x: torch.Tensor, patch: int, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the non-overlapping patch x patch tiles of images (B, C, H, W) by ``perm``."""
    B, C, H, W = x.shape
    gh, gw = H // patch, W // patch
    tiles = x.view(B, C, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C, patch, patch)
    tiles = tiles[:, perm]
    return tiles.view(B, gh, gw, C, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_vit_sees_patch_order_only_through_position_embeddings(pool):
    torch.manual_seed(0)
    model = create_model("vit", depth=2, pool=pool).eval()
    cfg = model.cfg
    x = torch.randn(4, 1, 8, 8)
    perm = torch.randperm(cfg.num_patches, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(perm, torch.arange(cfg.num_patches))
    x_perm = _permute_patches(x, cfg.patch_size, perm)
    assert not torch.equal(x, x_perm)
    with torch.no_grad():
        # With learned position embeddings the patch order matters...
        assert (model(x) - model(x_perm)).abs().max() > 1e-4
        # ...and without them the model is a set function of its patches.
        model.pos_embed.zero_()
        torch.testing.assert_close(model(x), model(x_perm), rtol=1e-5, atol=1e-5)


def test_vit_dropout_is_active_only_in_training():
    torch.manual_seed(0)
    model = create_model("vit", depth=2, dropout=0.5)
    x = torch.randn(4, 1, 8, 8)
    assert not torch.equal(model(x), model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


def test_vit_init():
    torch.manual_seed(0)
    model = create_model("vit", dim=128)
    w = model.blocks[0].attn.qkv.weight
    assert abs(w.std().item() - 0.02) < 0.002  # trunc normal, std 0.02
    assert w.abs().max() <= 2.0  # truncated at +-2 (absolute), as nn.init.trunc_normal_ does
    assert torch.count_nonzero(model.blocks[0].mlp.fc1.bias) == 0
    assert torch.equal(model.norm.weight, torch.ones(128))


def test_vit_cls_token_and_token_count():
    model = create_model("vit", pool="cls", image_size=8, patch_size=4)
    assert model.pos_embed.shape == (1, 4 + 1, 64)
    tokens = model.forward_embed(torch.randn(2, 1, 8, 8))
    assert tokens.shape == (2, 5, 64)  # (B, N, D)
    assert create_model("vit").pos_embed.shape == (1, 16, 64)


def _vit_pair(**options) -> tuple[nn.Module, nn.Module]:
    """The same ViT weights in the batch-first and the batch-second layout."""
    torch.manual_seed(0)
    first = create_model("vit", batch_first=True, **options)
    second = create_model("vit", batch_first=False, **options)
    assert [(n, p.shape) for n, p in first.named_parameters()] == [(n, p.shape) for n, p in second.named_parameters()]
    second.load_state_dict(first.state_dict())
    return first, second


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_vit_batch_second_computes_the_same_function(pool):
    """batch_first=False keeps tokens (N, B, D) between embedding and head: same weights, same
    input, the same logits (fp32, 1e-6) and the same gradients; the tokens are the transpose."""
    first, second = _vit_pair(pool=pool, depth=2)
    x = torch.randn(5, 1, 8, 8)
    out1, out2 = first(x), second(x)
    torch.testing.assert_close(out2, out1, rtol=0, atol=1e-6)
    out1.square().sum().backward()
    out2.square().sum().backward()
    for (name, p1), p2 in zip(first.named_parameters(), second.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        tokens = first.forward_embed(x)  # (B, N, D)
        assert tokens.shape == (5, 16 + (pool == "cls"), 64)
        torch.testing.assert_close(second.forward_embed(x), tokens.transpose(0, 1), rtol=0, atol=0)  # (N, B, D)
        h1, h2 = tokens, tokens.transpose(0, 1)
        for b1, b2 in zip(first.blocks, second.blocks):
            h1, h2 = b1(h1), b2(h2)
        torch.testing.assert_close(h2, h1.transpose(0, 1), rtol=0, atol=1e-6)


def test_vit_batch_second_trains_the_same():
    """A few AdamW steps from the same weights on the same batches: the same losses and weights."""
    first, second = _vit_pair(pool="cls", depth=2)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.05) for m in (first, second)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        losses = []
        for model, opt in zip((first, second), opts):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0])
    for (name, p1), p2 in zip(first.named_parameters(), second.parameters()):
        if name.endswith("attn.qkv.bias"):
            # the key bias adds the same number to every score of a query, which softmax cancels:
            # its true gradient is 0, so Adam turns the two layouts' rounding noise into steps of
            # up to lr; it changes no output (checked below)
            p1, p2 = torch.cat([p1[:64], p1[128:]]), torch.cat([p2[:64], p2[128:]])
        torch.testing.assert_close(p2, p1, rtol=1e-5, atol=1e-5, msg=name)
    x = torch.randn(8, 1, 8, 8, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(second(x), first(x), rtol=0, atol=1e-5)


def test_vit_batch_first_must_be_a_bool():
    with pytest.raises(ValueError, match="batch_first='no'"):
        create_model("vit", batch_first="no")


def test_vit_blocks_split_reproduces_forward():
    """Running embed -> blocks -> head by hand (as a pipeline stage split does) equals forward."""
    torch.manual_seed(0)
    model = create_model("vit").eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        h = model.forward_embed(x)
        for block in model.blocks:
            h = block(h)
        torch.testing.assert_close(model.forward_head(h), model(x), rtol=0, atol=0)


@pytest.mark.e2e
def test_vit_learns_a_tiny_task():
    """A few Adam steps fit a small fixed batch: the model can actually learn."""
    torch.manual_seed(0)
    model = create_model("vit", dim=32, depth=2, heads=2)
    x = torch.randn(32, 1, 8, 8)
    y = torch.arange(32) % 10
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 2.0 and loss.item() < 0.5 * first


def test_import_is_light(fresh_python):
    code = "import sys, kiln.models; print('sklearn' in sys.modules, 'kiln.parallel' in sys.modules, 'kiln.train' in sys.modules)"
    out = fresh_python(code)
    assert out.split() == ["False", "False", "False"]
    assert kiln.models.create_model is create_model


@pytest.mark.parametrize("config, count", [("gpt2_small.py", 124_475_904), ("gpt2_medium.py", 354_823_168),
                                           ("bert_large.py", 335_174_458)])
def test_published_sizes_by_config(config, count):
    """The bundled configs of the published sizes build models with the published parameter
    counts (on the meta device: shapes only, no memory)."""
    from pathlib import Path

    from kiln.config import load_config
    from kiln.train._build import build_model

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / config)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.head.out.weight is model.embed.tok.weight  # tied, counted once


def test_vit_b16_config_is_the_published_vit_b16_on_images_of_its_shape():
    """configs/vit_b16.py (kiln bench vit --device cuda): timm's vit_base_patch16_224 has
    86,567,656 parameters; its data are 3 x 224 x 224 images of 1000 classes."""
    from pathlib import Path

    from kiln.config import load_config
    from kiln.data import dataset_signature
    from kiln.train._build import build_model

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vit_b16.py")
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == 86_567_656
    assert (model.cfg.patch_size, model.cfg.dim, model.cfg.depth, model.cfg.heads) == (16, 768, 12, 12)
    assert model.blocks[0].mlp.fc1.out_features == 3072 and model.cfg.num_patches == 196
    args = dict(cfg.data.args)
    assert cfg.data.name == "synthetic_images" and "image_size" in dataset_signature(cfg.data.name).parameters
    data = (args["channels"], args["image_size"], args["num_classes"])
    assert data == (3, 224, 1000) == (model.cfg.in_channels, model.cfg.image_size, model.cfg.num_classes)
