"""The package's architecture: an acyclic import graph, layers that only import downwards, and
modules small enough to hold one concept each.

The graph counts every import of a `dpmix_jax` module, at module level or inside a function:
`from package import name` is an edge to the submodule `name` when there is one, else to the
package's `__init__`.
"""

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "dpmix_jax"
MAX_LINES = 950

# What each layer may import of the library (besides itself); `privacy` is the root. Top-level
# modules are their own layer: `parallel`, `checkout`, `interrupt` (infrastructure), `cli`.
ALLOWED = {
    "privacy": set(),
    "mixing": {"privacy"},
    "pate": {"privacy"},
    "models": {"privacy"},
    "data": {"privacy"},
    "train": {"privacy", "models", "data", "parallel", "interrupt"},
    "synthesis": {"privacy", "pate", "models", "data", "train"},
}
# The one module of a layer that may reach one layer more (teacher adapters over our models).
EXCEPTIONS = {"dpmix_jax.pate.teachers": {"models"}}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[module] = {
            target
            for name in targets
            if name.startswith("dpmix_jax") and (target := resolve(name)) not in (None, module)
        }
    return graph


GRAPH = _imports(_modules())


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_the_import_graph_is_acyclic():
    try:
        tuple(graphlib.TopologicalSorter(GRAPH).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(layer):
    wrong = []
    for module, targets in GRAPH.items():
        if _layer(module) != layer:
            continue
        allowed = ALLOWED[layer] | EXCEPTIONS.get(module, set()) | {layer}
        wrong += [f"{module} -> {t}" for t in sorted(targets) if _layer(t) not in allowed]
    assert not wrong, wrong


def test_the_library_never_imports_the_experiments():
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "experiments"], module


def test_no_module_holds_more_than_one_concepts_worth_of_lines():
    long = {
        name: lines
        for name, path in _modules().items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
