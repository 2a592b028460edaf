"""The house rules of docs/architecture.md that a test can hold: imports point one way, modules
stay small, every package is named in the architecture document."""

from __future__ import annotations

import ast

from tests.conftest import REPO

GAEQ = REPO / "gaeq"
MAX_LINES = 400


def module_imports() -> dict[str, set[str]]:
    """gaeq module → the gaeq modules it imports at module level (imports inside functions are
    the deliberate way to defer heavy or upward imports)."""
    modules = {}
    for path in GAEQ.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gaeq"):
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("gaeq")}
        modules[name] = deps
    return {m: {d for d in deps if d in modules and d != m} for m, deps in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first walk meets."""
    done, path, found = set(), [], []

    def visit(module: str) -> None:
        path.append(module)
        for dep in sorted(graph[module]):
            if dep in path:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def test_no_import_circle():
    assert circles(module_imports()) == []


def test_the_control_a_circle_is_found():
    """The walk sees a circle where there is one: launch → external → launch, as it once was."""
    graph = module_imports()
    graph["gaeq.runtime.external"] = graph["gaeq.runtime.external"] | {"gaeq.runtime.launch"}
    assert ["gaeq.runtime.external", "gaeq.runtime.launch", "gaeq.runtime.external"] in circles(graph) or any(
        set(c) == {"gaeq.runtime.external", "gaeq.runtime.launch"} for c in circles(graph)
    )


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in GAEQ.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_architecture_names_every_package_and_module():
    doc = (REPO / "docs" / "architecture.md").read_text()
    for path in GAEQ.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            assert f"gaeq/{path.parent.relative_to(GAEQ)}/".replace("/./", "/") in doc or path.parent == GAEQ, path
        else:
            assert path.name in doc, f"docs/architecture.md does not name {path.relative_to(REPO)}"
