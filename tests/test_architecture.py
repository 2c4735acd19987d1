"""The layer boundaries of ``src/ulysses_sp`` (README, Architecture): packages import one way with no
cycle, every package says what it owns and may import, every collective lives in ``parallel/comm.py``,
no bare ``WORLD`` group, no oversized module, no flat module beside the packages but the ``checks`` leaf."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "ulysses_sp"

# Bottom to top, by package (the first component of a module's name); a module may import its own
# layer (without a cycle) and the ones below. The folder list is the architecture (README, Architecture).
LAYERS = [
    {"checks"},  # the validation vocabulary: a leaf
    {"parallel"},  # mesh, mesh shape, every collective, the SP loss reduction
    {"attention", "memory", "data", "config", "plan"},  # what runs inside a step; the planner's arithmetic
    {"objectives"},  # per-token log-probs for preference / RL losses (uses memory's tiling)
    {"vlm"},  # vision-language models: merge and mrope over the full sequence, then the shard (uses data)
    {"mixers"},  # SP for linear attention, state-space and convolution mixers (uses attention's layouts)
    {"state", "tasks"},  # precision, loading, checkpoints; the embedded defaults
    {"engine"},  # initialize(), Engine: wrapping, optimizer, divergence guard
    {"run", "integrations"},  # the train loop and its checks; HF Trainer / TRL
    {"rehearse"},  # the run's step on fake tensors and a fake process group (train --rehearse)
    {"cli"},  # argv and the launcher
]
MAX_LINES = 360
COLLECTIVE = re.compile(
    r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|all_to_all\w*|reduce_scatter\w*|barrier|send|recv|"
    r"isend|irecv|batch_isend_irecv|scatter|gather|reduce)\("
)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Modules of the package that ``name`` imports, at any depth of the file (lazy imports count)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    type_only = {  # imports under `if TYPE_CHECKING:` are annotations, not run-time dependencies
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }  # fmt: skip
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("ulysses_sp"):
                target = node.module.removeprefix("ulysses_sp").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ulysses_sp."):
                    found.add(alias.name.removeprefix("ulysses_sp."))
    return {m for m in found if m and m in modules and m != name}


def _layer(name: str) -> int:
    top = name.split(".")[0]
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"module {name!r} is in no layer of tests/test_architecture.py: place it")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items() if n}


def test_imports_run_one_way_up_the_layers():
    wrong = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, deps in _graph().items()
        for b in deps
        if _layer(b) > _layer(a)
    ]
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_import_graph_has_no_cycle():
    graph = _graph()
    # package __init__ files re-export their own submodules: edges from a package to its children
    # are not dependencies of the package's code
    graph = {a: {b for b in deps if not b.startswith(a + ".")} for a, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_small(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines > {MAX_LINES}; split it by concern"


def test_every_collective_lives_in_comm():
    found = []
    for name, path in _modules().items():
        if name == "parallel.comm":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COLLECTIVE.search(line):
                found.append(f"{name}.py:{i}: {line.strip()}")
    assert not found, "collectives outside comm.py:\n" + "\n".join(found)


def test_no_bare_world_group():
    found = []
    for name, path in _modules().items():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            # mesh.py names the default group once, as the layout's reduce_group
            if "group.WORLD" in line and not (name == "parallel.mesh" and "self._world" in line):
                found.append(f"{name}.py:{i}: {line.strip()}")
    assert not found, "bare WORLD groups (use SPMesh.reduce_group):\n" + "\n".join(found)


def test_every_package_says_what_it_owns_and_may_import():
    missing = []
    for init in sorted(SRC.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "May import:" not in doc:
            missing.append(init.parent.name)
    assert not missing, "package docstrings without a 'May import:' line: " + ", ".join(missing)


def test_the_folder_list_is_the_architecture():
    flat = sorted(p.stem for p in SRC.glob("*.py") if p.stem not in {"__init__", "checks"})
    assert not flat, f"flat top-level modules {flat}: put each in the package of its concern"
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    placed = set().union(*LAYERS)
    assert packages - {"checks"} <= placed, f"packages in no layer: {sorted(packages - placed)}"
