"""kiln's layers, read from the source with ``ast``: no import cycle between modules (so none
between packages either), and no module takes a private name or a private module of a package
it is not inside.

"Private" is Python's convention: ``_name`` (a module, or a name in a module) belongs to the
package that holds it and to that package's subpackages. ``kiln._plotting`` is usable everywhere in kiln; ``kiln.parallel._pp``
only inside ``kiln.parallel``. Imports under ``if TYPE_CHECKING:`` are for type checkers and
do not count; imports inside functions do (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every runtime import of kiln."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, None, child.lineno) for a in child.names if a.name.startswith("kiln"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                if module.split(".")[0] == "kiln":
                    for alias in child.names:
                        sub = f"{module}.{alias.name}"
                        found.append((sub, None, child.lineno) if sub in MODULES else (module, alias.name, child.lineno))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _owner_of_private(module: str) -> str | None:
    """The package a private module belongs to (``kiln.parallel`` for ``kiln.parallel._pp``),
    or None for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_module_imports_a_private_name_or_module_of_a_package_it_is_not_inside():
    wrong = []
    for name, imports in IMPORTS.items():
        for module, taken, line in imports:
            owner = _owner_of_private(module)
            if owner is not None and not _inside(name, owner):
                wrong.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports private module {module}")
            # a private name belongs to the package of the module that defines it
            home = module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]
            if taken and taken.startswith("_") and not taken.startswith("__") and not _inside(name, home):
                wrong.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line} takes {taken} from {module}")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_module_import_graph_has_no_cycle():
    graph = {name: {m for m, _, _ in imports if m in MODULES and m != name} for name, imports in IMPORTS.items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_checks_see_what_they_claim_to():
    # the scan finds lazy imports inside functions and skips type-checking-only ones
    loop = {m for m, _, _ in IMPORTS["kiln.train.loop"]}
    assert "kiln.train._setup" in loop
    assert "kiln.train" not in {m for m, _, _ in IMPORTS["kiln"]}  # only under TYPE_CHECKING or by string
    assert any(m == "kiln.models" for m, _, _ in IMPORTS["kiln.parallel._checks"])
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _owner_of_private("kiln.parallel._pp") == "kiln.parallel" and _owner_of_private("kiln.optim") is None


@pytest.mark.parametrize("package", ["kiln.config", "kiln.models", "kiln.optim", "kiln.data"])
def test_lower_layers_do_not_import_the_trainer_or_the_parallel_layer(package):
    # configs, models, optimizers and data are usable without training or torch.distributed's layouts
    above = ("kiln.train", "kiln.parallel", "kiln.bench", "kiln.commands")
    wrong = [(name, m) for name, imports in IMPORTS.items() if _inside(name, package)
             for m, _, _ in imports if any(_inside(m, a) for a in above)]
    assert not wrong, wrong


def _unit(module: str) -> str | None:
    """The declared package or top-level module ``module`` belongs to (kiln._layers.LAYERS)."""
    from kiln._layers import LAYERS

    units = [u for layer in LAYERS for u in layer]
    return max((u for u in units if module == u or module.startswith(u + ".")), key=len, default=None)


def test_every_module_belongs_to_a_declared_layer():
    outside = {"kiln", "kiln.__main__"}  # the lazy facade and the entry point
    assert [m for m in MODULES if m not in outside and _unit(m) is None] == []


def test_no_import_runs_up_the_declared_order_and_no_package_cycle():
    from kiln._layers import LAYERS

    floor = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    upward: list[str] = []
    edges: dict[str, set[str]] = {u: set() for u in floor}
    for name, imports in IMPORTS.items():
        a = _unit(name)
        if a is None:
            continue
        for target, _, line in imports:
            b = _unit(target)
            if b is None or a == b:
                continue
            edges[a].add(b)
            if floor[b] > floor[a]:
                upward.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line} ({a}, layer {floor[a]}) imports {b} "
                              f"(layer {floor[b]})")
    assert upward == []
    assert _cycles(edges) == []


def test_the_layering_checks_see_an_upward_import_and_a_package_cycle():
    from kiln._layers import LAYERS

    floor = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    assert floor["kiln.optim"] < floor["kiln.train"] < floor["kiln.launch"] < floor["kiln.commands"]
    assert _cycles({"kiln.models": {"kiln.data"}, "kiln.data": {"kiln.models"}, "kiln.optim": set()}) != []


# -- the optimizer's contract (kiln/optim/_contract.py) is what other packages ask of an optimizer --

ARENA_INTERNALS = {"optimizer", "packing", "sharding"}  # a ZeRO wrapper's inner optimizer, the arenas' innards


def _contract_members() -> set[str]:
    """What KilnOptimizer and ShardableOptimizer promise beyond torch.optim's interface, read from
    their class bodies."""
    torch_optim = {"param_groups", "state", "step", "zero_grad", "state_dict", "load_state_dict"}
    names = set()
    for node in ast.parse((ROOT / "optim" / "_contract.py").read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in ("KilnOptimizer", "ShardableOptimizer"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return names - torch_optim


def _probes(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every ``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` of one of ``names``,
    and every read of an arena internal (``x.packing``, ``x.sharding``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.Attribute) and node.attr in ARENA_INTERNALS - {"optimizer"}:
            found.append((node.lineno, node.attr))
    return found


def test_the_contract_scan_finds_probes():
    members = _contract_members()
    assert {"contiguous", "flat_grads", "grad_parts", "wait_parameters", "shard_pieces", "grad_buffers",
            "state_tensors", "materialize_grads", "park_grads", "shard"} <= members
    assert "step" not in members and "state_dict" not in members  # torch.optim's own interface
    source = ('f = getattr(opt, "flat_grads", None)\nif hasattr(o, "wait_parameters"): pass\n'
              'opt.packing.packs\ngetattr(m, "weight")\nx = opt.flat_grads()\n')
    assert _probes(source, members) == [(1, "flat_grads"), (2, "wait_parameters"), (3, "packing")]


def test_no_module_outside_kiln_optim_probes_the_optimizer():
    """Precision, parallel, clipping, memory, checkpoints and benchmarks ask a KilnOptimizer
    (isinstance) and call its members; none looks for a member with getattr or hasattr, or
    reaches into the arenas' packing and sharding."""
    names = _contract_members() | ARENA_INTERNALS
    wrong = []
    for name, path in MODULES.items():
        if _inside(name, "kiln.optim"):
            continue
        where = str(path.relative_to(ROOT.parent))
        wrong += [f"{where}:{line} {probed}" for line, probed in _probes(path.read_text(), names)]
    assert not wrong, "\n".join(wrong)


def test_no_module_reads_a_dtensors_private_local_tensor():
    """DTensor's public ``to_local()`` (or kiln.optim.local_tensor), never its ``_local_tensor``."""
    wrong = [str(path.relative_to(ROOT.parent)) for path in MODULES.values() if "_local_tensor" in path.read_text()]
    assert not wrong, wrong


def test_whether_the_arena_is_there_is_asked_of_the_contract_not_the_class():
    """Outside kiln.optim nothing imports ArenaOptimizer (the implementation): "on its arena" is
    kiln.optim.has_arena, "what is refused without it" kiln.optim's one table; the config check
    and the runtime both read it."""
    wrong = [f"{MODULES[name].relative_to(ROOT.parent)}:{line}" for name, imports in IMPORTS.items()
             if not _inside(name, "kiln.optim") for module, taken, line in imports
             if _inside(module, "kiln.optim") and taken == "ArenaOptimizer"]
    assert not wrong, wrong
    readers = {"kiln.config._load": "arena_conflicts", "kiln.parallel._zero": "arena_missing",
               "kiln.precision": "arena_missing", "kiln.parallel._reducer": "has_arena",
               "kiln.parallel._layout": "NO_ARENA"}
    for name, taken in readers.items():
        assert any(_inside(m, "kiln.optim") and t == taken for m, t, _ in IMPORTS[name]), (name, taken)


# -- how long a function may grow -----------------------------------------------------------------

def test_no_function_in_kiln_is_over_80_lines_nor_a_class_over_300():
    """A function that does one thing reads on one screen (STYLE.md); kiln/optim's own test holds
    its classes to 300 lines, and this one every function and class of kiln/."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                long.append(f"{rel}:{node.lineno} {node.name}: {size} lines")
            elif isinstance(node, ast.ClassDef) and size > 300:
                long.append(f"{rel}:{node.lineno} class {node.name}: {size} lines")
    assert long == []
