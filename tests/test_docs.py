"""The docs agree with the code they describe.

- The step sketched on docs/reference/architecture.md makes the calls ``train_step`` makes into
  the layers that own each phase (``precision.*``, ``par.*``, ``scheduler.*``), in the same order:
  reordering the step, or renaming or adding a phase, fails here until the page says so too.
- Every relative link in the README, CONTRIBUTING.md and docs/ names a file that exists (and a
  heading of it, for ``page.md#heading``); every ``docs/...md`` a code file names exists, and a
  pointer ``(docs/lab/facts.md, 'Heading')`` names a heading of that page.
- docs/reference/config.md and cli.md are what the config schema and the command's parser
  generate. After changing either, rewrite both with ``python tests/test_docs.py``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "reference" / "architecture.md"
LOOP = ROOT / "kiln" / "train" / "loop.py"
CONFIG_REFERENCE = ROOT / "docs" / "reference" / "config.md"
CLI_REFERENCE = ROOT / "docs" / "reference" / "cli.md"
SCHEMA = ROOT / "kiln" / "config" / "_schema.py"
STEP_MARKER = "<!-- the step: "
LAYERS = ("precision", "par", "scheduler")  # the objects a step's phases are calls into
REGENERATE = "regenerate it with `python tests/test_docs.py`"


# -- the step ------------------------------------------------------------------------------------
def _phases(tree: ast.AST) -> list[str]:
    """The calls into the layers, in the order they are written: ``precision.backward``,
    ``par.pipeline.step``, ``scheduler.step``, ... (``run.precision.backward`` counts as
    ``precision.backward``: whatever holds the layer, the call is the phase)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        parts, target = [], node.func
        while isinstance(target, ast.Attribute):
            parts.append(target.attr)
            target = target.value
        if isinstance(target, ast.Name):
            parts.append(target.id)
        dotted = parts[::-1]
        layer = next((i for i, name in enumerate(dotted) if name in LAYERS), None)
        if layer is not None:
            found.append((node.lineno, node.col_offset, ".".join(dotted[layer:])))
    return [name for *_, name in sorted(found)]


def _documented_step() -> str:
    text = ARCHITECTURE.read_text()
    assert text.count(STEP_MARKER) == 1, f"{ARCHITECTURE.name} marks one code block as the step ({STEP_MARKER}...)"
    after = text[text.index(STEP_MARKER):]
    block = re.search(r"```python\n(.*?)\n```", after, re.DOTALL)
    assert block is not None and after.index("```python") < after.index("\n\n"), \
        "the step's marker stands right above a ```python block"
    return block.group(1)


def _train_step() -> ast.FunctionDef:
    (fn,) = [n for n in ast.parse(LOOP.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "train_step"]
    return fn


def test_the_architecture_pages_step_makes_train_steps_calls_in_its_order():
    documented, code = _phases(ast.parse(_documented_step())), _phases(_train_step())
    # what train_step does today, so that a reader of this test knows what the two agree on
    assert code.index("precision.backward") < code.index("par.reduce_gradients") < code.index("precision.unscale") \
        < code.index("par.clip") < code.index("precision.step") < code.index("scheduler.step") \
        < code.index("precision.zero_grad")
    assert documented == code, ("docs/reference/architecture.md's step and kiln/train/loop.py's train_step call "
                                f"the layers differently:\n  page: {documented}\n  code: {code}")


def test_the_step_check_fails_when_the_code_is_reordered_or_renamed():
    fn = _train_step()
    source = ast.unparse(fn)
    swapped = source.replace("par.reduce_gradients()", "@@").replace("precision.unscale(optimizer)",
                                                                     "par.reduce_gradients()").replace(
        "@@", "precision.unscale(optimizer)")
    renamed = source.replace("par.clip(", "par.clip_norm(")
    documented = _phases(ast.parse(_documented_step()))
    assert _phases(ast.parse(swapped)) != documented and _phases(ast.parse(renamed)) != documented
    assert _phases(ast.parse(source)) == documented


# -- links and pointers ----------------------------------------------------------------------------
def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in _prose(page.read_text()).splitlines() if line.startswith("#")]


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)  # fenced blocks hold no links


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {linked})")
        elif anchor and linked.suffix == ".md" and anchor not in {_slug(h) for h in _headings(linked)}:
            broken.append(f"{target} (no heading #{anchor} in {linked})")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = {str(p.relative_to(ROOT)): b for p in _pages() if (b := _broken_links(p))}
    assert broken == {}


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path):
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# B\n\n## What a step holds\n")
    page.write_text("# A\n[ok](b.md#what-a-step-holds) [gone](c.md) [nohead](b.md#other) [web](https://x.org/y)\n"
                    "```\n[in code](d.md)\n```\n")
    assert [b.split(" ")[0] for b in _broken_links(page)] == ["c.md", "b.md#other"]


def _pointers(text: str) -> list[tuple[str, str | None]]:
    """(page, heading or None) of every ``docs/PAGE.md`` in ``text``; a pointer to an entry reads
    ``(docs/lab/facts.md, 'Heading')``, on one line ('!' for one that does not)."""
    found = []
    for match in re.finditer(r"docs/([\w/.-]+?\.md)(, ')?", text):
        heading = None
        if match.group(2):
            rest = re.match(r"(.+?)'\)", text[match.end():].split("\n")[0])
            heading = rest.group(1) if rest else "!"
        found.append((match.group(1), heading))
    return found


def _is_heading(page: Path, heading: str) -> bool:
    """``heading`` is a heading of ``page``, or one less its note in parentheses ("gloo's
    collectives on CPU" for "gloo's collectives on CPU (B, torch 2.13)")."""
    return any(h == heading or h.startswith(heading + " (") for h in _headings(page))


def test_every_docs_page_and_heading_the_code_points_to_exists():
    pointers = [(str(path.relative_to(ROOT)), page, heading)
                for path in sorted([*(ROOT / "kiln").rglob("*.py"), *(ROOT / "tests").glob("*.py")])
                if path.name != Path(__file__).name for page, heading in _pointers(path.read_text())]
    assert sum(heading is not None for *_, heading in pointers) >= 20  # figures live in the lab notebook
    missing = [(f, page, heading) for f, page, heading in pointers
               if not (ROOT / "docs" / page).exists()
               or (heading is not None and not _is_heading(ROOT / "docs" / page, heading))]
    assert missing == []


def test_the_pointer_check_reads_an_entry_and_finds_a_wrong_one(tmp_path):
    page = tmp_path / "facts.md"
    page.write_text("# Facts\n\n## gloo's collectives on CPU (B, torch 2.13)\n")
    text = ("# slow on gloo (docs/lab/facts.md, 'gloo's collectives on CPU'); see docs/lab/gpu.md\n"
            "# (docs/lab/facts.md, 'gloo's\n# collectives on CPU')\n")
    assert _pointers(text) == [("lab/facts.md", "gloo's collectives on CPU"), ("lab/gpu.md", None),
                               ("lab/facts.md", "!")]
    assert _is_heading(page, "gloo's collectives on CPU") and not _is_heading(page, "gloo's collectives")


def test_the_benchmarks_write_into_the_lab_notebook():
    from kiln.bench import DOCS_PAGE
    from kiln.bench._harness import DOCS

    assert DOCS == ROOT / "docs" / "lab" / "benchmarks.md" and DOCS.exists()
    assert all(DOCS.with_name(page).exists() for page in DOCS_PAGE.values())


# -- generated references -------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


def _comments(source: str) -> dict[int, str]:
    return {tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def config_reference() -> str:
    """docs/reference/config.md: every key of kiln/config/_schema.py's namespaces, with its type,
    default and the comments written at it (on its line and the comment lines right above it)."""
    from kiln.config import _schema

    source = SCHEMA.read_text()
    lines, comments = source.splitlines(), _comments(source)
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def above(line: int) -> list[str]:
        out = []
        while line - 1 >= 1 and lines[line - 2].strip().startswith("#"):
            line -= 1
            out.insert(0, comments[line])
        return out

    def rows(cls: ast.ClassDef, prefix: str) -> list[str]:
        out = []
        for node in cls.body:
            if not isinstance(node, ast.AnnAssign):
                continue
            key, kind = f"{prefix}.{node.target.id}", ast.get_source_segment(source, node.annotation)
            default = ast.get_source_segment(source, node.value) if node.value is not None else ""
            factory = re.fullmatch(r"field\(default_factory=(?:lambda: )?(.*)\)", default)
            if factory:
                default = {"dict": "{}", "list": "[]"}.get(factory.group(1), factory.group(1))
            said = [*above(node.lineno), *([comments[node.lineno]] if node.lineno in comments else [])]
            out.append(f"| `{key}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(' '.join(said))} |")
            nested = [name for name in re.findall(r"\w+", kind) if name in classes]
            if nested:
                out.extend(rows(classes[nested[0]], key))
        return out

    text = ["# Config keys", "",
            "Generated from `kiln/config/_schema.py` by `tests/test_docs.py` (run `python tests/test_docs.py` after",
            "changing the schema; the test fails while this page differs). Any key is set in a config file or",
            "overridden as `key=value` on the command line; unknown keys and wrong types are refused before",
            "anything is built. How to use them: [the guide](../guide/configs.md).", "",
            "`model.*` is not declared here: its keys are the options of the chosen model (the fields of its",
            "config dataclass, `kiln.models.model_config_class(name)`) or the arguments of a `_target_`.",
            "`data.args` holds the keyword arguments of the chosen data set's builder; a `data._target_` (your",
            "own function returning the training and validation data sets) takes every key of `data` not",
            "declared below."]
    for namespace, schema in _schema.NAMESPACES.items():
        if schema is None:
            continue
        cls = classes[schema.__name__]
        first = next(n for n in cls.body if isinstance(n, ast.AnnAssign))
        intro = [comments[i] for i in range(cls.lineno + 1, first.lineno) if i in comments and i not in
                 {j for j in range(first.lineno - len(above(first.lineno)), first.lineno)}]
        text += ["", f"## {namespace}", ""]
        if intro:
            text += [" ".join(intro), ""]
        text += ["| key | type | default | what it does |", "|---|---|---|---|", *rows(cls, namespace)]
    return "\n".join(text) + "\n"


def _parser() -> argparse.ArgumentParser:
    """The ``kiln`` command's parser, found through the entry point pyproject.toml declares
    (wherever the command's module lives): its main() is run until it asks to parse."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1]
    target = re.search(r'^kiln\s*=\s*"([^"]+)"', scripts, re.MULTILINE).group(1)  # (tomllib: Python 3.11+)
    module, _, function = target.partition(":")
    main = getattr(importlib.import_module(module), function)
    seen: list[argparse.ArgumentParser] = []

    class Parsed(Exception):
        pass

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        seen.append(self)
        raise Parsed

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", grab)
        with contextlib.suppress(Parsed):
            main(["--help"])
    return seen[0]


def _argument(action: argparse.Action) -> str:
    metavar = action.metavar if action.metavar is not None else (
        action.dest.upper() if action.option_strings else action.dest)
    shown = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    if not action.option_strings:
        return {"?": f"[{shown}]", "*": f"[{shown} ...]", "+": f"{shown} [{shown} ...]"}.get(action.nargs, shown)
    takes = action.nargs != 0 and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                                          argparse._VersionAction, argparse._HelpAction))
    return " ".join(action.option_strings) + (f" {shown}" if takes else "")


def cli_reference() -> str:
    """docs/reference/cli.md: each command's description and arguments, from the parser."""
    parser = _parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    summary = {a.dest: a.help for a in commands._choices_actions}
    text = ["# The `kiln` command", "",
            "Generated from the command's parser by `tests/test_docs.py` (run `python tests/test_docs.py` after",
            "changing a command; the test fails while this page differs). `kiln COMMAND --help` prints the same.", "",
            "```text", parser.description.rstrip(), "```", "",
            "| command | what it does |", "|---|---|",
            *(f"| [`kiln {name}`](#kiln-{name}) | {_cell(summary[name])} |" for name in commands.choices)]
    for name, sub in commands.choices.items():
        text += ["", f"## kiln {name}", "", "```text", sub.description.rstrip(), "```", "",
                 "| argument | what it does |", "|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            said = (action.help or "") % {**vars(action), "prog": sub.prog}
            if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings \
                    and "default" not in said:
                said += f" (default: {action.default})"
            text.append(f"| `{_cell(_argument(action))}` | {_cell(said)} |")
    return "\n".join(text) + "\n"


REFERENCES = {CONFIG_REFERENCE: config_reference, CLI_REFERENCE: cli_reference}


@pytest.mark.parametrize("page", list(REFERENCES), ids=lambda p: p.name)
def test_the_generated_reference_is_current(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: {REGENERATE}"
    written, generated = page.read_text(), REFERENCES[page]()
    assert written == generated, f"{page.relative_to(ROOT)} differs from what the code generates: {REGENERATE}"


def test_the_config_reference_holds_every_key_with_its_default():
    from kiln.config import _schema

    text = config_reference()
    for namespace, schema in _schema.NAMESPACES.items():
        for f in dataclasses.fields(schema) if schema is not None else ():
            assert f"| `{namespace}.{f.name}` |" in text, (namespace, f.name)
    assert "| `train.accumulate` | `int` | `1` | micro-batches per optimizer step" in text
    assert "| `train.loggers` | " in text and '| `["csv"]` |' in text
    assert "| `train.early_stopping.patience` | `int` | `5` |" in text


if __name__ == "__main__":
    for reference, generate in REFERENCES.items():
        reference.write_text(generate())
        print(f"wrote {reference.relative_to(ROOT)}", file=sys.stderr)
