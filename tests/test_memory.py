"""Tests for kiln.memory: activation checkpointing changes memory, never the numbers."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from kiln.memory import apply_ac, checkpointed_blocks, remove_ac
from kiln.models import create_model


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return create_model("vit", depth=4, dim=32, heads=4, dropout=0.1)


def _train_grads(mode: str, steps: int = 3, every: int = 2) -> list[list[torch.Tensor]]:
    """Gradients of each of ``steps`` SGD steps; the same seeds for every mode."""
    model = _vit()
    apply_ac(model, mode, every=every)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(123)  # dropout masks come from the global generator
    grads = []
    for _ in range(steps):
        x = torch.randn(4, 1, 8, 8, generator=data)
        y = torch.randint(0, 10, (4,), generator=data)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_gradients_bitwise_equal_with_dropout(mode):
    reference = _train_grads("none")
    checkpointed = _train_grads(mode)
    for step, (ref, got) in enumerate(zip(reference, checkpointed)):
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), f"{mode}: step {step}, parameter {i} differs"
    # Dropout is active: a different seed gives different gradients, so the equality above is not vacuous.
    torch.manual_seed(0)
    model = _vit()
    x = torch.randn(4, 1, 8, 8)
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    assert not torch.equal(a, model(x))


def test_ac_actually_recomputes():
    """The checkpointed blocks run their forward twice per step (once more in backward)."""
    model = _vit()
    calls = []
    for i, block in enumerate(model.blocks):
        block.norm1.register_forward_hook(lambda *_, i=i: calls.append(i))
    assert apply_ac(model, "selective", every=3) == [0, 3]
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    assert sorted(calls) == [0, 0, 1, 2, 3, 3]


def test_state_dict_keys_unchanged_and_loads_into_plain_model():
    plain = _vit()
    wrapped = _vit()
    apply_ac(wrapped, "full")
    assert list(wrapped.state_dict().keys()) == list(plain.state_dict().keys())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():
        for p in wrapped.parameters():
            p.add_(1.0)
    plain.load_state_dict(wrapped.state_dict())  # strict: same keys both ways
    wrapped.load_state_dict(plain.state_dict())
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a, b)


def test_modes_none_and_remove_and_copy():
    model = _vit()
    assert apply_ac(model, "full") == [0, 1, 2, 3]
    assert checkpointed_blocks(model) == [0, 1, 2, 3]
    assert apply_ac(model, "selective", every=2) == [0, 2]
    assert checkpointed_blocks(model) == [0, 2]
    # A wrapped model still deep-copies and pickles, and the copy stays checkpointed.
    clone = copy.deepcopy(model)
    assert checkpointed_blocks(clone) == [0, 2]
    assert clone.blocks[0].forward.module is clone.blocks[0]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert checkpointed_blocks(torch.load(buf, weights_only=False)) == [0, 2]
    remove_ac(model)
    assert checkpointed_blocks(model) == []
    apply_ac(model, "full")
    assert apply_ac(model, "none") == []
    assert checkpointed_blocks(model) == []


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class _OutsideModel(nn.Module):
    """Laid out like models from outside kiln: the blocks are not at model.blocks, and other
    containers of one type (the stem's two Linears, the short head list) must not be chosen."""

    def __init__(self, width: int = 8, depth: int = 4, sequential: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
        blocks = [_Block(width) for _ in range(depth)]
        self.encoder = nn.Module()
        self.encoder.layers = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.heads = nn.ModuleList([nn.Linear(width, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if isinstance(self.encoder.layers, nn.Sequential):
            x = self.encoder.layers(x)
        else:
            for block in self.encoder.layers:
                x = block(x)
        return self.heads[0](x)


@pytest.mark.parametrize("sequential", [True, False])
def test_ac_finds_the_repeated_blocks_of_a_model_from_outside_kiln(sequential):
    from kiln.models import repeated_blocks

    torch.manual_seed(0)
    plain = _OutsideModel(sequential=sequential)
    model = copy.deepcopy(plain)
    assert repeated_blocks(model) is model.encoder.layers  # the 4 blocks, not the stem's 2 or the head's 1
    calls = []
    for i, block in enumerate(model.encoder.layers):
        block.norm.register_forward_hook(lambda *_, i=i: calls.append(i))
    assert apply_ac(model, "full") == [0, 1, 2, 3]
    x = torch.randn(5, 8)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert sorted(calls) == [0, 0, 1, 1, 2, 2, 3, 3]  # each block ran again in backward
    for (name, a), (other, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert name == other and torch.equal(a.grad, b.grad), name  # names unchanged, gradients bitwise
    # train.ac_blocks names another container where the guess is wrong
    assert apply_ac(model, "full", blocks="stem") == [0, 1]
    assert checkpointed_blocks(model, "stem") == [0, 1] and checkpointed_blocks(model) == []
    with pytest.raises(TypeError, match="train.ac_blocks"):
        apply_ac(model, "full", blocks="encoder.nothing")
    with pytest.raises(TypeError, match="not an nn.ModuleList or nn.Sequential"):
        apply_ac(model, "full", blocks="heads.0")


def test_clear_errors():
    with pytest.raises(TypeError, match="no repeated blocks.*train.ac_blocks"):
        apply_ac(nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="mode"):
        apply_ac(_vit(), "everything")
    with pytest.raises(ValueError, match="every"):
        apply_ac(_vit(), "selective", every=0)


@pytest.mark.parametrize("command", [["train"], ["train", "--nproc", "2"], ["plan"]])
def test_checkpointing_a_model_without_blocks_is_a_one_line_config_error_before_anything_is_built(
        tmp_path, capsys, command):
    from kiln.commands import main

    config = tmp_path / "linear.yaml"
    config.write_text("model: {_target_: torch.nn.Linear, in_features: 64, out_features: 10}\n"
                      "train: {max_steps: 2, activation_checkpointing: full}\n")
    runs = tmp_path / "runs"
    code = main([command[0], str(config), *command[1:], f"train.output_dir={runs}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "train.activation_checkpointing=full" in err and "Linear" in err
    assert "activation_checkpointing=none" in err  # the way out
    assert not runs.exists()
