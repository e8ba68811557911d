"""kiln.optim's shape (issues 25 and 40), read from the source with ``ast``: no class over 300
lines and no function over 80, no private name imported from one of its modules into another,
no collective (kiln.optim never communicates; whoever shards it supplies the sums), and each
optimizer a chain of the shared transforms, with no update method of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPTIM = Path(__file__).resolve().parents[1] / "kiln" / "optim"
MODULES = sorted(OPTIM.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_class_is_over_300_lines(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno - node.lineno + 1 <= 300, f"{path.name}: class {node.name} has " \
                f"{node.end_lineno - node.lineno + 1} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_function_is_over_80_lines(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name} has " \
                f"{node.end_lineno - node.lineno + 1} lines"


def test_each_optimizer_is_a_chain_of_the_shared_transforms_with_no_update_of_its_own():
    """A class declares its chain once; the flat, list and compiled paths derive from it (a
    torch or native kernel that fuses the chain is declared beside it, and tested against it)."""
    import kiln.optim as ko  # (imported here: the other tests of this file read only the source)
    from kiln.optim import _chain

    for node in ast.walk(ast.parse((OPTIM / "_optimizers.py").read_text())):
        if isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            assert not methods & {"_update_flat", "_update_list", "state_names"}, node.name
    for cls in ko.OPTIMIZERS.values():
        for decoupled in (False, True):
            chain = cls.chain_for({"decoupled_weight_decay": decoupled})
            assert isinstance(chain, _chain.Chain) and chain.transforms, cls
            for t in chain.transforms:
                assert (t.update or t.ratio).__module__ == "kiln.optim._chain", (cls, t)
    assert repr(ko.LAMB.chain) == "chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, learning_rate)"
    assert ko.AdamW.chain_for({"decoupled_weight_decay": True}) is ko.Adam.chain_for({"decoupled_weight_decay": True})


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_private_name_is_imported_from_another_module_of_kiln_optim(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kiln.optim"):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                       and node.module != "kiln.optim"]  # (kiln.optim's private modules: _rules, _native)
            assert not private, f"{path.name} imports {private} from {node.module}"


COLLECTIVES = {"all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather_single", "all_gather", "broadcast", "reduce", "reduce_scatter", "all_to_all", "barrier"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_kiln_optim_runs_no_collective(path):
    """(It may ask torch.distributed for the world size; DTensor's own redistribution, which
    completes a DTensor's statistics, is torch's, not a collective written here.)"""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            assert "dist" not in base, f"{path.name} calls {base}.{node.attr}"
        if isinstance(node, ast.ImportFrom) and "distributed" in (node.module or ""):
            assert not COLLECTIVES & {a.name for a in node.names}, f"{path.name} imports a collective"
