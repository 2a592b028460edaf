"""The house rules of docs/architecture.md that a test can hold: imports point one way, modules
stay small, every package is named in the architecture document."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

GAEQ = REPO / "gaeq"
MAX_LINES = 400


def runtime_imports(tree: ast.AST) -> list[ast.stmt]:
    """Every import statement that runs — at module level or inside a function (a deferred import
    is still an edge) — but those under `if TYPE_CHECKING:`, which only a type checker reads."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def module_name(path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports_of(source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, gaeq module) for every gaeq module `source` imports, at module level or inside a function."""
    found = []
    for node in runtime_imports(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gaeq"):
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names = {a.name for a in node.names if a.name.startswith("gaeq")}
        else:
            continue
        found += [(node.lineno, name) for name in sorted(names) if name in modules]
    return found


def import_edges() -> list[tuple[str, str, int, str]]:
    """(module, its file, line, the gaeq module it imports) for every import of gaeq that runs."""
    paths = {module_name(path): path for path in GAEQ.rglob("*.py")}
    return [
        (module, str(path.relative_to(REPO)), line, dep)
        for module, path in sorted(paths.items())
        for line, dep in imports_of(path.read_text(), set(paths))
        if dep != module
    ]


def module_imports() -> dict[str, set[str]]:
    """gaeq module → the gaeq modules it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {module_name(path): set() for path in GAEQ.rglob("*.py")}
    for module, _, _, dep in import_edges():
        graph[module].add(dep)
    return graph


def declared_floors(doc: str) -> dict[str, tuple[int, str]]:
    """docs/architecture.md's layer table: module or package → (floor, the floor's name). A name
    followed by "(the package)" is its `__init__` alone (key ending in ":"); any other covers its modules."""
    layers = doc[doc.index("## Layers") :]
    floors = {}
    for number, name, cell in re.findall(r"^\| (\d+) ([^|]+?) \| ([^|]+) \|", layers, flags=re.M):
        for module, alone in re.findall(r"`(gaeq(?:\.\w+)*)`( \(the package\))?", cell):
            floors[module + (":" if alone else "")] = (int(number), name.strip())
    return floors


def floor_of(module: str, floors: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    """The floor of the package's own row, or of the longest row naming `module` or a package it is in."""
    if module + ":" in floors:
        return floors[module + ":"]
    owners = [m for m in floors if module == m or module.startswith(m + ".")]
    return floors[max(owners, key=len)] if owners else None


def upward_imports(edges: list[tuple[str, str, int, str]], floors: dict[str, tuple[int, str]]) -> list[str]:
    """Every import that points up a floor, and every module no row of the table covers."""
    found = []
    for module in sorted({e[0] for e in edges} | {e[3] for e in edges}):
        if floor_of(module, floors) is None:
            found.append(f"{module} has no floor in docs/architecture.md's layer table")
    for module, path, line, dep in edges:
        here, there = floor_of(module, floors), floor_of(dep, floors)
        if here and there and there[0] > here[0]:
            found.append(f"{path}:{line} imports {dep} (floor {there[0]}, {there[1]}) from floor {here[0]} ({here[1]})")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first walk meets."""
    done, path, found = set(), [], []

    def visit(module: str) -> None:
        path.append(module)
        for dep in sorted(graph[module]):
            if dep in path:
                found.append(path[path.index(dep) :] + [dep])
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


def test_imports_point_down_the_floors_of_the_architecture():
    doc = (REPO / "docs" / "architecture.md").read_text()
    floors = declared_floors(doc)
    assert len({floor for floor, _ in floors.values()}) >= 7
    assert upward_imports(import_edges(), floors) == []


def test_the_control_an_upward_import_is_named_with_its_file_line_and_floors():
    """A deferred import of the runtime from the problem's spec — read from source as every module
    is — fails, and so does a module no row covers."""
    floors = declared_floors((REPO / "docs" / "architecture.md").read_text())
    source = "from __future__ import annotations\n\n\ndef check(spec):\n    from gaeq.runtime import launch\n"
    modules = {module_name(path) for path in GAEQ.rglob("*.py")}
    upward = [("gaeq.problem.spec", "gaeq/problem/spec.py", line, dep) for line, dep in imports_of(source, modules)]
    assert upward_imports(upward, floors) == [
        "gaeq/problem/spec.py:5 imports gaeq.runtime (floor 5, processes) from floor 1 (the problem)",
        "gaeq/problem/spec.py:5 imports gaeq.runtime.launch (floor 5, processes) from floor 1 (the problem)",
    ]
    # a new package must be placed
    stray = [("gaeq.newfloor.thing", "gaeq/newfloor/thing.py", 3, "gaeq.files")]
    assert upward_imports(stray, floors) == ["gaeq.newfloor.thing has no floor in docs/architecture.md's layer table"]


def package_of(module: str) -> str:
    """The gaeq package a module is in (`gaeq.script.probe` → `gaeq.script`); a module of gaeq itself is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (GAEQ / parts[-1]).is_dir() else module


def into_packages_above(edges: list[tuple[str, str, int, str]], floors: dict[str, tuple[int, str]]) -> list[str]:
    """Every import into another package from below any of that package's floors: a room a lower floor reaches into
    must sit wholly below it (the script's spec, once in script/ beside its launch, was read by the problem)."""
    highest: dict[str, int] = {}
    for module in {e[0] for e in edges} | {e[3] for e in edges}:
        if (floor := floor_of(module, floors)) is not None:
            highest[package_of(module)] = max(highest.get(package_of(module), -1), floor[0])
    found = []
    for module, path, line, dep in edges:
        here, theirs = floor_of(module, floors), package_of(dep)
        if package_of(module) != theirs and here and highest.get(theirs, -1) > here[0]:
            found.append(f"{path}:{line} imports {dep}, of {theirs}, which holds floor {highest[theirs]}, from floor "
                         f"{here[0]}")  # fmt: skip
    return found


def test_no_package_is_reached_into_from_below_its_highest_floor():
    floors = declared_floors((REPO / "docs" / "architecture.md").read_text())
    assert into_packages_above(import_edges(), floors) == []


def test_the_control_an_import_into_a_package_that_spans_floors_from_below_its_top_is_named():
    """gaeq's trainers (floor 4) reading the probe's targets (floor 4) is level by module, but script/ holds its
    launch on floor 5 too: named. The same import from the runtime (floor 5) is not."""
    floors = declared_floors((REPO / "docs" / "architecture.md").read_text())
    edges = import_edges()
    extra = ("gaeq.trainers.recorder", "gaeq/trainers/recorder.py", 1, "gaeq.script.targets")
    assert into_packages_above([*edges, extra], floors) == [
        "gaeq/trainers/recorder.py:1 imports gaeq.script.targets, of gaeq.script, which holds floor 5, from floor 4"
    ]
    assert into_packages_above([*edges, ("gaeq.runtime.worker", *extra[1:])], floors) == []


def test_the_control_an_import_inside_a_function_counts_and_a_type_only_one_does_not():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gaeq.matrix.expand import Expander\n"
        "def add(ex):\n    from gaeq.matrix.resume import add_resume\n"
    )
    assert sorted(n.module for n in runtime_imports(tree)) == ["gaeq.matrix.resume", "typing"]


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(REPO)): n for p in GAEQ.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def named_paths(doc: str) -> set[str]:
    """Every gaeq file the document names, as a whole path: `gaeq/x/y.py` written out, or `y.py`
    in the table row of package `gaeq/x/` (or of module `gaeq/y.py` itself)."""
    named = set(re.findall(r"`(gaeq/[\w/]+\.py)`", doc))
    for row in re.findall(r"^\| `(gaeq/[\w/]*)` \|(.*)$", doc, flags=re.M):
        package, text = row
        if package.endswith(".py"):
            named.add(package)
        else:
            named |= {f"{package}{name}" for name in re.findall(r"`(\w+\.py)`", text)}
    return named


def test_architecture_names_every_module_by_its_whole_path():
    doc = (REPO / "docs" / "architecture.md").read_text()
    modules = {str(p.relative_to(REPO)) for p in GAEQ.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    named = named_paths(doc)
    assert modules - named == set(), "docs/architecture.md does not name these modules"
    assert named - modules == set(), "docs/architecture.md names modules that do not exist"
    packages = {f"gaeq/{p.parent.relative_to(GAEQ)}/" for p in GAEQ.rglob("__init__.py") if p.parent != GAEQ}
    assert {p for p in packages if f"`{p}`" not in doc} == set()


def test_the_control_a_module_named_only_inside_another_name_is_not_named():
    """`load.py` inside `preload.py`, `hf.py` inside `preload_hf.py`: no longer enough."""
    row = "| `gaeq/runtime/` | `preload.py` (the fork server's imports), `preload_hf.py` |"
    assert named_paths(row) == {"gaeq/runtime/preload.py", "gaeq/runtime/preload_hf.py"}


EXTERNAL = ("torch", "deepspeed", "transformers", "accelerate", "typer", "rich", "pydantic", "pytest")
"""First parts of dotted names that belong to a dependency, not to gaeq."""
FILES = (".py", ".json", ".jsonl", ".yaml", ".md", ".png", ".log", ".safetensors")


def code_index() -> tuple[dict[str, ast.Module], dict[str, list[ast.ClassDef]]]:
    """gaeq's modules by every dotted suffix of their name (launch, runtime.launch,
    gaeq.runtime.launch; a package by its own name) and its classes by name."""
    modules: dict[str, list[ast.Module]] = {}
    classes: dict[str, list[ast.ClassDef]] = {}
    for path in GAEQ.rglob("*.py"):
        tree = ast.parse(path.read_text())
        parts = path.relative_to(REPO).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        for i in range(len(parts)):
            modules.setdefault(".".join(parts[i:]), []).append(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    return {k: v[0] for k, v in modules.items() if len(v) == 1}, classes


def defined_names(body: list[ast.stmt]) -> set[str]:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def resolves(dotted: str, modules, classes) -> bool:
    """Whether `module.name`, `Class.member` or `module.Class.member` names something in gaeq."""
    if dotted in modules and dotted.startswith("gaeq."):  # a module by its whole name
        return True
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
        if ".".join(parts[:cut]) in modules:
            scope, rest = modules[".".join(parts[:cut])].body, parts[cut:]
            break
    else:
        if len(classes.get(parts[0], [])) != 1:
            return False
        scope, rest = classes[parts[0]][0].body, parts[1:]
    for i, name in enumerate(rest):
        if name not in defined_names(scope):
            return False
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == name]
        if i < len(rest) - 1:
            if not found and len(classes.get(name, [])) == 1:  # imported class
                found = classes[name]
            if not found:
                return False
            scope = found[0].body
    return True


def dotted_names(doc: str) -> set[str]:
    """Every backticked `a.b` of the document that is not a file name nor a dependency's."""
    names = set()
    for token in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`]*\))?`", doc):
        if not token.endswith(FILES) and token.split(".")[0] not in EXTERNAL:
            names.add(token)
    return names


def test_every_dotted_name_in_the_architecture_exists_in_the_code():
    modules, classes = code_index()
    names = dotted_names((REPO / "docs" / "architecture.md").read_text())
    assert len(names) > 20
    assert sorted(n for n in names if not resolves(n, modules, classes)) == []


def test_the_control_a_renamed_function_is_found():
    modules, classes = code_index()
    assert resolves("server.preload_modules", modules, classes)
    assert resolves("Expander.cell", modules, classes) and resolves("build.BuiltProblem.micro_loss", modules, classes)
    assert not resolves("base.build_problem_that_was_renamed", modules, classes)
    assert not resolves("Expander.no_such_method", modules, classes)
    assert dotted_names("`trace.jsonl`, `deepspeed.zero.Init`, `api.run(x)`") == {"api.run"}


def bug_sites(tree: ast.AST) -> list[ast.Compare]:
    """Comparisons with a cell's planted bug: `<x>.bug == …` / `!=` / `in`."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "bug"
    ]


def named_bug(site: ast.Compare) -> str | None:
    """The member a site compares with (`Bug.X`), or None when it names none (a bare string...)."""
    right = site.comparators[0]
    if isinstance(right, ast.Attribute) and isinstance(right.value, ast.Name) and right.value.id == "Bug":
        return right.attr
    return None


def every_bug_site() -> dict[str, list[str]]:
    """Member name → where it is compared with; a site that names no member under "?"."""
    sites: dict[str, list[str]] = {}
    for path in sorted((REPO / "gaeq").rglob("*.py")):
        for site in bug_sites(ast.parse(path.read_text())):
            if isinstance(site.comparators[0], ast.Constant) and site.comparators[0].value is None:
                continue  # `cell.bug is None`-style checks name no bug
            where = f"{path.relative_to(REPO)}:{site.lineno}"
            sites.setdefault(named_bug(site) or "?", []).append(where)
    return sites


def test_every_planted_bug_has_a_site_and_every_site_names_a_planted_bug():
    """A bug that no line plants would be a control that never fires; a site comparing with a bare
    string could be misspelt and never fire either (gaeq/bugs.py)."""
    from gaeq.bug_catalogue import BUGS
    from gaeq.bugs import Bug

    sites = every_bug_site()
    assert "?" not in sites, f"compare cell.bug with a Bug member, not a string: {sites.get('?')}"
    assert set(sites) <= {m.name for m in Bug}, f"no such Bug member: {set(sites) - {m.name for m in Bug}}"
    assert {m.name for m in Bug} <= set(sites), f"planted bugs no line plants: {({m.name for m in Bug}) - set(sites)}"
    assert set(BUGS) == {m.value for m in Bug}


def test_the_control_a_string_site_is_found():
    tree = ast.parse('if cell.bug == "no_loss_divison":\n    pass\nif cell.bug == Bug.LR_ZERO:\n    pass\n')
    assert [named_bug(site) for site in bug_sites(tree)] == [None, "LR_ZERO"]


def trainer_functions(tree: ast.Module) -> set[str]:
    """The functions a trainer module defines at its top level."""
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


TRAINER_FUNCTIONS = {"train", "promised"}
"""What a registered trainer's module defines: ``train(*, cell, problem, ctx)`` and what its label
promises, ``promised(cell, problem)`` (gaeq/trainers/provenance.py checks it after step 1)."""
SCRIPT_FUNCTIONS = {"run_script_cell"}
"""What the module of a trainer that runs a user's script defines instead (gaeq/script/launch.py)."""


def test_every_registered_trainer_module_trains_and_says_what_it_promises():
    from gaeq.registry import TRAINERS

    for spec in TRAINERS.values():
        for module in (spec.module, spec.pipeline) if spec.pipeline else (spec.module,):
            path = REPO / (module.replace(".", "/") + ".py")
            wanted = SCRIPT_FUNCTIONS if spec.script else TRAINER_FUNCTIONS
            missing = wanted - trainer_functions(ast.parse(path.read_text()))
            assert not missing, f"{module} (trainer {spec.name}) does not define {sorted(missing)}"


def test_the_control_a_trainer_module_without_promises_is_found():
    tree = ast.parse("def train(*, cell, problem, ctx):\n    return {}\n")
    assert TRAINER_FUNCTIONS - trainer_functions(tree) == {"promised"}


def test_the_cli_imports_no_torch_so_that_gaeq_run_starts_its_fork_server_first(tmp_path):
    """`gaeq run` starts the fork server that imports torch for the ranks (gaeq/runtime/server.py) before it
    checks the problems: a torch the CLI imports on its way there is a second of start-up in front of every run.
    (The control: the same question of a module that imports a torch — a stand-in, a folder of that name.)"""
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "imports_torch.py").write_text("import torch\n")

    def imports_torch(module: str, *, path: str = "") -> bool:
        code = f"import sys; sys.path.insert(0, {path!r}); import {module}; print('torch' in sys.modules)"
        said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
        return said.stdout.strip().splitlines()[-1] == "True"

    assert not imports_torch("gaeq.cli")
    assert imports_torch("imports_torch", path=str(tmp_path))


def unmarked_integration_files(files: dict[str, str]) -> list[str]:
    """The files of tests/integration (name → text) whose tests are not marked `integration`: they start processes,
    yet the edit loop (`-m "not integration"`) would run them."""
    marked = re.compile(r"pytestmark = .*pytest\.mark\.integration")
    return sorted(name for name, text in files.items() if not marked.search(text))


def test_every_integration_test_file_is_marked_integration():
    files = {p.name: p.read_text() for p in (REPO / "tests" / "integration").glob("test_*.py")}
    assert len(files) > 20 and unmarked_integration_files(files) == []


def test_the_control_an_unmarked_integration_file_is_named():
    marked = "pytestmark = [pytest.mark.integration, pytest.mark.first_use_build]\n"
    assert unmarked_integration_files({"test_a.py": marked, "test_b.py": "import pytest\n"}) == ["test_b.py"]
