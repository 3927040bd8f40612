"""Every ```python snippet in README.md and docs/*.md runs, so the docs cannot rot.

Each snippet runs in a fresh interpreter (device layouts are fixed per process); one that starts with
``# run with: paraml launch`` runs as a 2-worker launch. A snippet that cannot run here says so on its first line:
``# not run: <reason>``. Docstring examples of the public API run too (doctest).
"""

import doctest
import importlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def snippets():
    for doc in DOCS:
        for number, match in enumerate(FENCE.finditer(doc.read_text()), start=1):
            code = match.group(1)
            if not code.lstrip().startswith("# not run:"):
                yield pytest.param(code, id=f"{doc.name}-{number}")


def run_snippet(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    with tempfile.TemporaryDirectory() as cwd:
        command = [sys.executable, "-c", code]
        if code.startswith("# run with: paraml launch"):  # a multi-worker script: run it the way it says
            script = Path(cwd) / "train.py"
            script.write_text(code)
            command = [sys.executable, "-m", "paraml", "launch", "-n", "2", str(script)]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def snippet_runs():
    """Every snippet started at once, two at a time (a process spends its first seconds importing on one core)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {code: pool.submit(run_snippet, code) for code in (p.values[0] for p in snippets())}


@pytest.mark.parametrize("code", list(snippets()))
@pytest.mark.slow
def test_snippet_runs(code, snippet_runs):
    done = snippet_runs[code].result()
    assert done.returncode == 0, f"snippet failed:\n{code}\n--- output ---\n{done.stdout}\n{done.stderr[-3000:]}"


def test_there_are_snippets():
    assert len(list(snippets())) >= 5


MODULES = [
    "paraml.parallel",
    "paraml.loop.training",
    "paraml.devices",
    "paraml.planning.partition",
    "paraml.memory",
    "paraml.planning.observe",
    "paraml.planning.optimizers",
    "paraml.planning.sizes",
    "paraml.checks",
    "paraml.auto",
    "paraml.cluster.config",
    "paraml.cluster.detect",
    "paraml.cluster.rendezvous",
    "paraml.bench.trace",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_reference_names_every_public_name():
    import paraml

    reference = (ROOT / "docs" / "reference.md").read_text()
    missing = [name for name in paraml.__all__ if f"`{name}" not in reference]
    assert not missing, f"docs/reference.md does not document: {missing}"


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under ``heading`` in docs/reference.md."""
    text = (ROOT / "docs" / "reference.md").read_text()
    lines = text.split(heading, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip("|"))] for row in rows[2:]]


def _names(cell: str) -> set[str]:
    """The backticked identifiers of a table cell (``name`` or ``name(...)``)."""
    return {re.match(r"[\w.]+", name).group(0) for name in re.findall(r"`([^`]+)`", cell)}


def test_reference_module_table_is_the_code():
    rows = _table("## Modules")
    documented = {_names(module).pop(): (kind, _names(names)) for module, kind, names in rows}
    import paraml

    package = Path(paraml.__file__).parent
    on_disk = {  # every module, as imported; those whose file starts with "_" are run, not imported
        ".".join(("paraml", *p.relative_to(package).with_suffix("").parts)).removesuffix(".__init__")
        for p in package.rglob("*.py")
        if not p.name.startswith("_") or p.name == "__init__.py"
    }
    assert set(documented) == on_disk, "docs/reference.md's module table and src/paraml differ"
    for module, (kind, names) in documented.items():
        assert kind in ("public", "internal"), f"{module}: kind must be public or internal, got {kind!r}"
        assert names == set(importlib.import_module(module).__all__), f"{module}: names differ from __all__"


def test_reference_contract_table_is_the_code():
    from paraml.backends import Backend

    documented = set().union(*(_names(member) for member, *_ in _table("## The backend contract")))
    members = {name for name in vars(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
    assert documented == members
