"""kiln.optim's shape (issue 25), read from the source with ``ast``: no class over 300 lines,
no private name imported from one of its modules into another, and no collective: kiln.optim
never communicates; whoever shards it supplies the sums."""

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
