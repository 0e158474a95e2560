"""The layers are one-way (specdec <- workers <- jobs), specdec's four rooms too (exec <- spec, plan <- sched), and no
module's imports lead back to it: read from the source, every import a module can run (at its top or inside its
functions; not `if TYPE_CHECKING:` blocks)."""

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..")
LAYERS = ("specdec", "workers", "jobs")  # each may import only those before it
# specdec's rooms (docs/DESIGN.md), and the rooms each may not import: one forward knows no drafts, rows or policies;
# what is drafted and accepted, and how long to draft, know no batch
ROOMS = {"exec": ("spec", "plan", "sched"), "spec": ("plan", "sched"), "plan": ("sched",), "sched": ()}


def modules() -> dict[str, str]:
    """module name -> file, for every module of the three packages."""
    out = {}
    for package in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """The project modules `name` can import."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()

    def add(target: str) -> None:
        while target and target not in known:  # `from pkg import module` or `from module import name`
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            visit(ast.iter_child_nodes(node))
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)

    visit(tree.body)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_layers_import_only_the_layers_below():
    for name, deps in graph().items():
        allowed = LAYERS[: LAYERS.index(name.split(".")[0]) + 1]
        wrong = sorted(d for d in deps if d.split(".")[0] not in allowed)
        assert not wrong, f"{name} imports {wrong}"


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [node, dep]))
            if dep not in state:
                walk(dep, path + [node])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            walk(node, [])


def room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "specdec" and len(parts) > 2 and parts[1] in ROOMS else None


def test_specdec_rooms_import_one_way():
    g = graph()
    assert {room(n) for n in g} >= set(ROOMS), "every room has modules"
    for name, deps in g.items():
        if (mine := room(name)) is None:
            continue
        wrong = sorted(d for d in deps if room(d) in ROOMS[mine])
        assert not wrong, f"{name} ({mine}/) imports {wrong}"
