"""The package's design, kept by CI: import layers, no cycles, rooms, private Keras/TF access in one file.

Pure ``ast`` and ``re`` over the files under ``src/paraml``: nothing of paraml, TensorFlow or Keras is imported, so
this runs in well under a second.

The layers, bottom to top (a module may import its own layer or a lower one, never a higher one):

a. foundations: ``paraml.checks``, ``paraml.internals``, ``paraml.devices``, ``paraml.data``, ``paraml.planning.*``
b. techniques: ``paraml.parallelism.*``
c. backends: ``paraml.backends.*``
d. the training loop: ``paraml.loop.*``
e. the facade: ``paraml.parallel``, ``paraml.auto``, ``paraml.memory``, ``paraml.many``, ``paraml.demo``
f. entry points: ``paraml.bench.*``, ``paraml.cli``, ``paraml.__main__``

``paraml.cluster.*`` is a side room without TensorFlow: it imports only ``paraml.checks`` and itself, and any layer
may import it. ``paraml/__init__.py`` (lazy public names) is exempt as an importer.

On top of the layers: the loop imports no technique (``paraml.parallelism``) and, of the backends, only the contract
``paraml.backends.base``; the facade ``paraml.parallel`` imports no backend implementation (only the package's
registry functions and ``paraml.backends.base``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "paraml"

#: (layer letter, what lives there, module prefixes); a prefix ``p`` covers ``p`` and ``p.*``
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("a", "foundations", ("paraml.checks", "paraml.internals", "paraml.devices", "paraml.data", "paraml.planning")),
    ("b", "techniques", ("paraml.parallelism",)),
    ("c", "backends", ("paraml.backends",)),
    ("d", "the training loop", ("paraml.loop",)),
    ("e", "the facade", ("paraml.parallel", "paraml.auto", "paraml.memory", "paraml.many", "paraml.demo")),
    ("f", "entry points", ("paraml.bench", "paraml.cli", "paraml.__main__")),
]
CLUSTER = "paraml.cluster"
CLUSTER_MAY_IMPORT = ("paraml.checks", CLUSTER)
#: what the loop may import of the backends: the contract
LOOP_BACKENDS = {"paraml.backends.base"}
#: what the facade may import of the backends: the registry functions (the package re-exports them) and the contract
FACADE_BACKENDS = {"paraml.backends", "paraml.backends.registry", "paraml.backends.base"}
FACADE = "paraml.parallel"
#: packages the side room ``paraml.cluster`` never imports (``paraml launch`` starts processes without TensorFlow)
HEAVY = ("tensorflow", "keras", "tf_keras")

MAX_TOP_LEVEL_FILES = 12
ID_KEYED_DICT = re.compile(r"\b[A-Z_][A-Z0-9_]*\[id\(")
INTERNALS = "internals.py"  # relative to src/paraml: the one file allowed to touch Keras/TF internals
#: attribute names ``setattr`` may put on another object, and why: data of one traced graph, which lives and dies with
#: it (the plan is never kept this way)
MARKERS_ALLOWED = {"GRAPH_SLICES": "the slices of a traced graph's joined tensors"}
PRIVATE_ATTRIBUTES = (
    "flatten_layers|tracker|layers|inbound_nodes|trainable_variables|distribution_strategy|distributed_tf_update_step"
    "|collective_key_base|keras_mask|autocast|lock_state|self_tracked_trackables|obj_reference_counts|variables"
)
PRIVATE = re.compile(
    r"\b(keras\.src|tensorflow\.python|tf\.python|tf\.__internal__)\b|\._(" + PRIVATE_ATTRIBUTES + r")\b"
)
PRIVATE_NAME = re.compile(r"_(" + PRIVATE_ATTRIBUTES + r")")
OWN_OBJECT = re.compile(r"\b(self|cls)$")  # ``self._layers`` is the object's own attribute, not Keras'
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


# --- reading the tree ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    path: Path
    where: str  # the path shown in messages: src/paraml/... for the real tree
    module: str
    is_package: bool
    text: str
    tree: ast.Module


@dataclass(frozen=True)
class Import:
    source: Source
    line: int
    statement: str
    target: str  # a module of the tree (``paraml...``), or an outside top-level package (``tensorflow``)
    type_checking: bool  # under ``if TYPE_CHECKING:``: checked for layers, not a cycle at run time
    runtime: bool = True  # False for ``pkg.submodule`` read as an attribute (the package imported it already)

    @property
    def where(self) -> str:
        return f"{self.source.where}:{self.line}"


def _display(path: Path, root: Path) -> str:
    """``path`` as messages show it: from the repository for the real tree, from the package's parent otherwise."""
    base = REPO if root.is_relative_to(REPO) else root.parent
    return path.relative_to(base).as_posix()


@cache  # parsed once per session: the checks below share it
def read_tree(root: Path) -> dict[str, Source]:
    """Every module under ``root`` (a package directory named like the package), by dotted name."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        text = path.read_text(encoding="utf-8")
        module = ".".join(parts)
        tree = ast.parse(text, filename=str(path))
        sources[module] = Source(path, _display(path, root), module, is_package, text, tree)
    return sources


def lazy_exports(sources: dict[str, Source], package: str) -> dict[str, str]:
    """The root package's lazy public names (``_EXPORTS = {"Parallel": "parallel", ...}``): name -> module."""
    init = sources.get(package)
    if init is None:
        return {}
    for node in init.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(node.value, ast.Dict):
            return {
                k.value: f"{package}.{v.value}"
                for k, v in zip(node.value.keys, node.value.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
            }
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``node`` with whether it sits under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, type_checking
            yield child.test, type_checking
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
        else:
            yield child, type_checking
            yield from _walk(child, type_checking)


def _dotted(node: ast.expr) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


@cache
def all_imports(root: Path) -> dict[str, list[Import]]:
    """What each module of the tree under ``root`` imports (:func:`imports_of`), by module."""
    sources = read_tree(root)
    return {module: imports_of(src, sources, root.name) for module, src in sources.items()}


def imports_of(src: Source, sources: dict[str, Source], root_package: str) -> list[Import]:
    """What ``src`` imports: modules of the tree (the deepest module an import names) and outside packages.

    Counts imports at module level and inside functions, ``from pkg import submodule``, the root package's lazy
    names, ``importlib.import_module("...")`` with a constant, and ``alias.submodule`` read through an imported
    package (``from paraml import backends`` then ``backends.model_parallel``).
    """
    exports = lazy_exports(sources, root_package)
    package = src.module if src.is_package else src.module.rpartition(".")[0]
    found: list[Import] = []
    bound: dict[str, str] = {}  # a name bound by an import -> the tree's module it is

    lines = src.text.splitlines()

    def statement(node: ast.AST) -> str:  # the node's source, on one line (ast.get_source_segment is slow)
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        chunk = [line.encode() for line in lines[first : last + 1]]
        chunk[-1] = chunk[-1][: node.end_col_offset]
        chunk[0] = chunk[0][node.col_offset :]
        return " ".join(b" ".join(chunk).decode().split())[:160]

    def add(node: ast.AST, target: str, type_checking: bool, runtime: bool = True) -> None:
        found.append(Import(src, node.lineno, statement(node), target, type_checking, runtime))

    def deepest(name: str) -> str | None:
        while name:
            if name in sources:
                return name
            name = name.rpartition(".")[0]
        return None

    nodes = list(_walk(src.tree))
    for node, type_checking in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root_package:
                    target = deepest(alias.name) or root_package
                    add(node, target, type_checking)
                    bound[alias.asname or root_package] = target if alias.asname else root_package
                else:
                    add(node, alias.name.split(".")[0], type_checking)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != root_package:
                add(node, name.split(".")[0], type_checking)
                continue
            module = deepest(name) or root_package
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                if sub in sources:  # from pkg import submodule
                    target = sub
                elif name == root_package and alias.name in exports:  # from paraml import Parallel (lazy)
                    target = exports[alias.name]
                else:
                    target = module
                add(node, target, type_checking)
                if target in sources and sources[target].is_package:
                    bound[alias.asname or alias.name] = target
        elif isinstance(node, ast.Call) and (_dotted(node.func) or [""])[-1] == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith(root_package):
                add(node, deepest(arg.value) or root_package, type_checking)

    for node, type_checking in nodes:  # pkg.submodule read through a bound package
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            names = _dotted(node)
            if names and names[0] in bound:
                module = deepest(".".join([bound[names[0]], *names[1:]]))
                if module and module != bound[names[0]] and module.startswith(bound[names[0]] + "."):
                    add(node, module, type_checking, runtime=False)
    seen = set()
    unique = []
    for imp in found:  # one ``backends.model_parallel.X`` read many times: reported once a line
        key = (imp.line, imp.target, imp.type_checking, imp.runtime)
        if key not in seen:
            seen.add(key)
            unique.append(imp)
    return unique


# --- the checks ------------------------------------------------------------------------------------------------------


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> tuple[int, str, str] | None:
    """(index, letter, description) of ``module``'s layer, or None when it is in none."""
    for index, (letter, description, prefixes) in enumerate(LAYERS):
        if any(_under(module, p) for p in prefixes):
            return index, letter, description
    return None


def _layer_name(module: str) -> str:
    layer = layer_of(module)
    return f"layer {layer[1]}: {layer[2]}" if layer else "the cluster side room" if _under(module, CLUSTER) else "?"


def check_layers(root: Path = SRC) -> list[str]:
    """The import-layer rule and its explicit parts (loop, facade, cluster), one message per forbidden import."""
    sources = read_tree(root)
    package = root.name
    problems = []
    for module, src in sources.items():
        if module == package:
            continue  # paraml/__init__.py: lazy public names, exempt
        if not _under(module, CLUSTER) and layer_of(module) is None:
            problems.append(
                f"{src.where}: {module} is in no layer; put it into one of the rooms and, for a new room or top-level "
                f"file, add it to LAYERS in tests/test_architecture.py (bottom to top: "
                + ", ".join(f"{letter} {', '.join(p)}" for letter, _, p in LAYERS)
                + ")"
            )
            continue
        for imp in all_imports(root)[module]:
            problems += [f"{imp.where}: `{imp.statement}`: {why}" for why in _forbidden(module, imp.target)]
    return problems


def _forbidden(module: str, target: str) -> list[str]:
    """Why ``module`` must not import ``target`` (empty when it may); each reason says what to do instead."""
    root = module.split(".")[0]
    if _under(module, CLUSTER):
        if target in HEAVY:
            return [
                f"{module} imports {target}, and paraml.cluster runs without TensorFlow (`paraml launch` only "
                f"starts processes); do this in a backend (paraml.backends.*) that reads the cluster's settings"
            ]
        if _under(target, root) and target != root and not any(_under(target, p) for p in CLUSTER_MAY_IMPORT):
            return [
                f"{module} imports {target}; the side room paraml.cluster imports only paraml.checks and "
                f"paraml.cluster.*: pass what it needs in as an argument, or move the code that needs {target} "
                f"out of paraml.cluster (a backend may read the cluster, not the other way round)"
            ]
        return []
    if not _under(target, root) or target == root or _under(target, CLUSTER):
        return []  # outside packages, the root's own names (__version__), the side room: anyone may
    reasons = []
    mine, theirs = layer_of(module), layer_of(target)
    if mine and theirs and theirs[0] > mine[0]:
        reasons.append(
            f"{module} ({_layer_name(module)}) imports {target} ({_layer_name(target)}), a higher layer; a module "
            f"imports only its own layer or lower ones: move what both need down to layer {mine[1]} or lower, or let "
            f"the higher layer pass it in (an argument, a callback, a Backend method)"
        )
    if _under(module, "paraml.loop") and _under(target, "paraml.parallelism"):
        reasons.append(
            f"the loop imports no technique, and {module} imports {target}; reach the technique through the backend "
            f"the loop is given (a method or capability of the contract paraml.backends.base.Backend), and wire "
            f"techniques in the backends or the facade"
        )
    if _under(module, "paraml.loop") and _under(target, "paraml.backends") and target not in LOOP_BACKENDS:
        reasons.append(
            f"the loop imports of the backends only the contract paraml.backends.base, and {module} imports {target}; "
            f"add what the loop needs to the Backend contract in paraml/backends/base.py and use the backend object "
            f"the loop is given"
        )
    if module == FACADE and _under(target, "paraml.backends") and target not in FACADE_BACKENDS:
        reasons.append(
            f"the facade {module} imports the backend implementation {target}; choose backends by name through the "
            f"registry (paraml.backends.get_backend/available) and talk to them through paraml.backends.base.Backend: "
            f"put backend-specific behaviour behind a Backend method, property or Capabilities flag"
        )
    return reasons


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself) (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, {})):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, {}):
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def check_cycles(root: Path = SRC) -> list[str]:
    """No import cycle among the tree's modules (imports in functions count; ``if TYPE_CHECKING:`` ones do not)."""
    sources = read_tree(root)
    package = root.name
    edges: dict[str, dict[str, Import]] = {}
    for module, imports in all_imports(root).items():
        for imp in imports:
            if imp.runtime and not imp.type_checking and imp.target in sources and imp.target != package:
                edges.setdefault(module, {}).setdefault(imp.target, imp)
    problems = []
    for component in _cycles(edges):
        members = set(component)
        start = component[0]
        # the shortest way from start back to itself inside the component
        paths = {start: [start]}
        queue = [start]
        cycle = None
        while queue and cycle is None:
            node = queue.pop(0)
            for nxt in sorted(edges.get(node, {})):
                if nxt == start:
                    cycle = paths[node] + [start]
                    break
                if nxt in members and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    queue.append(nxt)
        assert cycle is not None
        steps = "; ".join(f"{edges[a][b].where}: `{edges[a][b].statement}`" for a, b in zip(cycle, cycle[1:]))
        problems.append(
            f"import cycle {' -> '.join(cycle)} (modules in the cycle: {', '.join(component)}): {steps}; break it by "
            f"moving what both need into the lower module (or a lower layer), or by passing it in as an argument"
        )
    return problems


def check_top_level_files(root: Path = SRC) -> list[str]:
    files = sorted(p.name for p in root.glob("*.py"))
    if len(files) <= MAX_TOP_LEVEL_FILES:
        return []
    return [
        f"{_display(root, root)}/ has {len(files)} .py files directly in it ({', '.join(files)}), at most "
        f"{MAX_TOP_LEVEL_FILES}; put the new module into its room (planning/, parallelism/, backends/, loop/, "
        f"cluster/, bench/) instead of the package's top level"
    ]


@cache
def _masked_lines(src: Source) -> tuple[str, ...]:
    """The source's lines with comments and docstrings blanked out (so prose may name what code must not use)."""
    text, tree = src.text, src.tree
    lines = text.splitlines()
    blank: list[tuple[int, int, int, int]] = []  # (start line, start col, end line, end col), 1-based lines
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            blank.append((*token.start, *token.end))
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            blank.append((node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0))
    for start_line, start_col, end_line, end_col in blank:
        for number in range(start_line, end_line + 1):
            line = lines[number - 1]
            a = start_col if number == start_line else 0
            b = end_col if number == end_line else len(line)
            lines[number - 1] = line[:a] + " " * (b - a) + line[b:]
    return tuple(lines)


def check_id_keyed_dicts(root: Path = SRC) -> list[str]:
    problems = []
    for src in read_tree(root).values():
        for number, line in enumerate(_masked_lines(src), 1):
            for match in ID_KEYED_DICT.finditer(line):
                problems.append(
                    f"{src.where}:{number}: `{line.strip()}`: a module-level dict keyed by id() "
                    f"(`{match.group(0)}`) keeps its objects alive, and a reused id after garbage collection finds "
                    f"another object's entry; keep the state on the object itself (an attribute), in a "
                    f"weakref.WeakKeyDictionary, or in a dict local to the call that needs it"
                )
    return problems


def check_markers(root: Path = SRC) -> list[str]:
    """No ``setattr`` of a marker on another object (a Keras variable, layer, optimizer): what a plan decided is kept
    by the plan's objects, never re-derived from attributes stuck on Keras' (``internals.py`` is exempt)."""
    problems = []
    for src in read_tree(root).values():
        if src.path == root / INTERNALS:
            continue
        for node in ast.walk(src.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"):
                continue
            target, name = (node.args + [None, None])[:2]
            if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                continue
            if isinstance(name, ast.Name) and name.id in MARKERS_ALLOWED:
                continue
            line = src.text.splitlines()[node.lineno - 1].strip()
            problems.append(
                f"{src.where}:{node.lineno}: `{line[:160]}` sets an attribute on another object: keep what the plan "
                f"decided in the plan's own objects (an AppliedPlan, SplitWeights, ShardedSlots), keyed by the object"
            )
    return problems


def check_private_access(root: Path = SRC) -> list[str]:
    """Only ``internals.py`` imports ``keras.src``/``tensorflow.python`` or reads private Keras/TF attributes."""
    problems = []
    allowed = root / INTERNALS
    for src in read_tree(root).values():
        if src.path == allowed:
            continue
        hits: dict[int, list[str]] = {}
        for number, line in enumerate(_masked_lines(src), 1):
            for match in PRIVATE.finditer(line):
                if match.group(2) and OWN_OBJECT.search(line[: match.start()]):
                    continue
                hits.setdefault(number, []).append(match.group(0))
        for node in ast.walk(src.tree):  # getattr(obj, "_layers"): the same read, spelled as a string
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ATTRIBUTE_FUNCTIONS
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and PRIVATE_NAME.fullmatch(node.args[1].value)
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            ):
                hits.setdefault(node.lineno, []).append(f'{node.func.id}(..., "{node.args[1].value}")')
        lines = src.text.splitlines()
        for number in sorted(hits):
            problems.append(
                f"{src.where}:{number}: `{lines[number - 1].strip()[:160]}` uses {', '.join(hits[number])}: Keras/TF "
                f"internals are touched in one file only; move this access into src/paraml/{INTERNALS} behind a named "
                f"function (one place to fix when Keras or TensorFlow changes) and call that"
            )
    return problems


# --- the tree today --------------------------------------------------------------------------------------------------


def _report(problems: list[str]) -> str:
    return f"{len(problems)} violation(s) of the design (see tests/test_architecture.py):\n" + "\n".join(problems)


def test_the_tree_is_there():
    assert (SRC / "__init__.py").is_file()
    assert len(read_tree(SRC)) > 20  # the checks below read the real package, not an empty directory


def test_import_layers():
    problems = check_layers()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


def test_no_import_cycles():
    problems = check_cycles()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


def test_top_level_files():
    problems = check_top_level_files()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


def test_no_module_level_dicts_keyed_by_id():
    problems = check_id_keyed_dicts()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


def test_no_markers_on_other_objects():
    problems = check_markers()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


def test_keras_and_tensorflow_internals_only_in_internals():
    problems = check_private_access()
    if problems:
        pytest.fail(_report(problems), pytrace=False)


# --- the checks catch what they should -------------------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A synthetic ``paraml`` package under ``tmp_path`` with ``files`` (path -> source), packages made as needed."""
    root = tmp_path / "paraml"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            init = root / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(text)
    return root


def test_a_loop_module_importing_a_technique_is_reported(tmp_path):
    root = _tree(tmp_path, {"loop/x.py": "from paraml.parallelism.zero import owners\n", "parallelism/zero.py": ""})
    problems = check_layers(root)
    assert len(problems) == 1, problems
    assert problems[0].startswith("paraml/loop/x.py:1: `from paraml.parallelism.zero import owners`:")
    assert "the loop imports no technique" in problems[0] and "paraml.parallelism.zero" in problems[0]


@pytest.mark.parametrize(
    "files, expected",
    [
        (  # upward, from inside a function
            {"planning/p.py": "def f():\n    from paraml.loop.training import Trainer\n", "loop/training.py": ""},
            ["paraml/planning/p.py:2:", "a higher layer"],
        ),
        (  # upward, only for type checkers: still a layer violation
            {
                "parallelism/t.py": "import typing\nif typing.TYPE_CHECKING:\n    import paraml.backends.base\n",
                "backends/base.py": "",
            },
            ["paraml/parallelism/t.py:3:", "(layer b: techniques) imports paraml.backends.base (layer c: backends)"],
        ),
        (  # the loop and a backend implementation, through the package
            {"loop/s.py": "from paraml.backends import registry\n", "backends/registry.py": ""},
            ["paraml/loop/s.py:1:", "only the contract paraml.backends.base"],
        ),
        (  # the facade and a backend class
            {"parallel.py": "from paraml.backends.model_parallel import M\n", "backends/model_parallel.py": ""},
            ["paraml/parallel.py:1:", "backend implementation paraml.backends.model_parallel"],
        ),
        (  # the facade and a backend class, read through the package
            {
                "parallel.py": "from paraml import backends\n\nx = backends.model_parallel.ModelParallelBackend\n",
                "backends/model_parallel.py": "",
            },
            ["paraml/parallel.py:3:", "backend implementation paraml.backends.model_parallel"],
        ),
        (  # a lazy public name of the root package resolves to its module
            {
                "checks.py": "from paraml import Parallel\n",
                "parallel.py": "",
                "__init__.py": '_EXPORTS = {"Parallel": "parallel"}\n',
            },
            ["paraml/checks.py:1:", "imports paraml.parallel (layer e: the facade)"],
        ),
        (  # the side room reaching out
            {"cluster/c.py": "from paraml.devices import resolve_devices\n", "devices.py": ""},
            ["paraml/cluster/c.py:1:", "imports only paraml.checks and paraml.cluster.*"],
        ),
        (
            {"cluster/c.py": "def f():\n    import tensorflow as tf\n"},
            ["paraml/cluster/c.py:2:", "runs without TensorFlow"],
        ),
        (  # a module in no layer
            {"extra.py": "import os\n"},
            ["paraml/extra.py:", "in no layer"],
        ),
    ],
)
def test_layer_violations_are_reported(tmp_path, files, expected):
    problems = check_layers(_tree(tmp_path, files))
    assert len(problems) == 1, problems
    for part in expected:
        assert part in problems[0], problems[0]


def test_allowed_imports_pass(tmp_path):
    root = _tree(
        tmp_path,
        {
            "loop/s.py": "from paraml.backends.base import B\nfrom paraml.cluster.config import x\nimport keras\n",
            "backends/base.py": "from paraml.checks import check_int\n",
            "backends/__init__.py": "from paraml.backends.registry import get_backend\n",
            "backends/registry.py": "from paraml.backends.base import Backend\n",
            "parallel.py": "from paraml import backends, __version__\nfrom paraml.backends.base import Backend\n"
            "b = backends.get_backend\nr = backends.registry.available\n",
            "cluster/config.py": "from paraml.checks import check_int\nfrom paraml.cluster import logs\n",
            "cluster/logs.py": "",
            "checks.py": "",
            "cli.py": "from paraml.parallel import Parallel\n",
        },
    )
    assert check_layers(root) == []
    assert check_cycles(root) == []


def test_a_cycle_is_reported_and_type_checking_imports_are_not_one(tmp_path):
    root = _tree(
        tmp_path,
        {
            "planning/a.py": "from paraml.planning import b\n",
            "planning/b.py": "def f():\n    from paraml.planning.c import x\n",
            "planning/c.py": "import paraml.planning.a\n",
            "loop/x.py": "from paraml.loop.y import Y\n",
            "loop/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paraml.loop.x import X\n",
        },
    )
    problems = check_cycles(root)
    assert len(problems) == 1, problems
    assert "paraml.planning.a -> paraml.planning.b -> paraml.planning.c -> paraml.planning.a" in problems[0]
    assert "paraml/planning/b.py:2: `from paraml.planning.c import x`" in problems[0]


def test_the_other_rules_are_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            **{f"m{i}.py": "" for i in range(12)},
            "planning/p.py": (
                '"""Docs may name keras.src and layer._layers."""\n'
                "_CACHE = {}\n"
                "def f(layer, v):\n"
                "    _CACHE[id(layer)] = layer  # a comment may say x._layers\n"
                "    self._layers = layer._layers\n"
                '    return getattr(v, "_distribution_strategy", None)\n'
                "import tensorflow.python.ops\n"
            ),
            "parallelism/t.py": (
                "GRAPH_SLICES = 'x'\n"
                "def tag(variable, graph, parts):\n"
                "    setattr(self, 'parts', parts)\n"
                "    setattr(graph, GRAPH_SLICES, {})\n"
                "    setattr(variable, '_paraml_parts', parts)\n"
            ),
            "internals.py": "def f(model):\n    return model._flatten_layers()\n",
        },
    )
    assert "has 14 .py files" in check_top_level_files(root)[0]
    (id_problem,) = check_id_keyed_dicts(root)
    assert id_problem.startswith("paraml/planning/p.py:4:") and "`_CACHE[id(`" in id_problem
    private = check_private_access(root)
    assert [p.split(" ", 1)[0] for p in private] == [
        "paraml/planning/p.py:5:",
        "paraml/planning/p.py:6:",
        "paraml/planning/p.py:7:",
    ], private
    assert "uses ._layers:" in private[0] and "self._layers" in private[0]
    assert 'getattr(..., "_distribution_strategy")' in private[1]
    assert "uses tensorflow.python:" in private[2] and "move this access into src/paraml/internals.py" in private[2]
    (marker,) = check_markers(root)
    assert marker.startswith("paraml/parallelism/t.py:5:") and "sets an attribute on another object" in marker
