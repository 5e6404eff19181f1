"""The package's folders run in pipeline order, and imports point down it (docs/architecture.md).

Read from the source with `ast`, so every import counts, those inside functions too:
- a module imports only from its own stage or the stages before it, and no two modules import each
  other, directly or around a loop;
- only the frontend, the JAX integration, the public API and the benchmarks import JAX, and the
  stages from `core` to `kernels` reach no module that does;
- only `integration/jax_internals.py` touches `jax._src`;
- codegen (`lowering/`) never refuses a plan: the planner decides;
- no function is over 100 lines.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxstitch"

# Stages in pipeline order; the top-level modules are the public API, the benchmarks use it.
STAGES = ("core", "frontend", "graph", "plan", "lowering", "kernels", "driver", "integration", "api", "bench")
JAX_STAGES = {"frontend", "integration", "api", "bench"}
JAX_FREE = {"core", "graph", "plan", "lowering", "kernels"}  # not even through another module
JAX_SRC = "jaxstitch.integration.jax_internals"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else "api"


def _absolute(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(jaxstitch modules `module` imports, other top-level packages and jax._src uses)."""
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):  # `from X import a`: module X.a, else X itself
            base = _absolute(module, path, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "jaxstitch":
                while name not in MODULES and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name != module and name != "jaxstitch":
                    ours.add(name)
            elif name:
                others.add("jax._src" if name.startswith("jax._src") else name.split(".")[0])
    return ours, others


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_belongs_to_a_stage():
    assert {stage(m) for m in MODULES} <= set(STAGES)
    top = sorted(m for m in MODULES if stage(m) == "api")
    assert top == ["jaxstitch", "jaxstitch.api", "jaxstitch.cache", "jaxstitch.nnx", "jaxstitch.targets"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_pipeline(module):
    upward = sorted(d for d in GRAPH[module][0] if STAGES.index(stage(d)) > STAGES.index(stage(module)))
    assert not upward, f"{module} ({stage(module)}) imports later stages: {upward}"


def test_no_import_cycles():
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):  # Tarjan's strongly connected components
        order[m] = low[m] = len(order)
        stack.append(m)
        for d in sorted(GRAPH[m][0]):
            if d not in order:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], order[d])
        if low[m] == order[m]:
            component = []
            while True:
                x = stack.pop()
                component.append(x)
                if x == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(MODULES):
        if m not in order:
            visit(m)
    assert not cycles, f"modules importing each other: {cycles}"


def test_only_the_frontend_integration_api_and_benchmarks_import_jax():
    importing = sorted(m for m, (_, others) in GRAPH.items() if others & {"jax", "jaxlib", "jax._src"})
    assert importing and all(stage(m) in JAX_STAGES for m in importing), \
        [m for m in importing if stage(m) not in JAX_STAGES]


def test_the_stages_before_the_driver_reach_no_jax():
    def reaches_jax(m, seen):
        if m in seen:
            return False
        seen.add(m)
        ours, others = GRAPH[m]
        return bool(others & {"jax", "jaxlib"}) or any(reaches_jax(d, seen) for d in ours)

    through = sorted(m for m in MODULES if stage(m) in JAX_FREE and reaches_jax(m, set()))
    assert not through, f"these reach a module that imports jax: {through}"


def test_only_jax_internals_touches_jax_src():
    assert sorted(m for m, (_, others) in GRAPH.items() if "jax._src" in others) == [JAX_SRC]


def test_codegen_decides_nothing():
    """Planning decides, codegen renders: no module of `lowering/` names the planner's refusal
    (`Unplannable`); a plan the templates cannot render is refused by the planner
    (planner.unrenderable), and codegen meeting one anyway is a bug (kernel.Unrenderable)."""
    naming = sorted(m for m, path in MODULES.items() if stage(m) == "lowering"
                    and any(isinstance(n, ast.Name) and n.id == "Unplannable" or
                            isinstance(n, ast.alias) and n.name == "Unplannable"
                            for n in ast.walk(ast.parse(path.read_text()))))
    assert naming == []


MAX_FUNCTION_LINES = 100  # (the house style aims at ~80; this is the hard limit)


def test_no_function_is_longer_than_the_limit():
    """Long functions are split along their natural steps; this keeps the package so."""
    long = [(f"{m}.{n.name}", n.end_lineno - n.lineno + 1) for m, path in MODULES.items()
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES]
    assert long == []
