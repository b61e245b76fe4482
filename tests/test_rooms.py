"""The house's rule: each room (a top-level package) imports only from rooms below it and from itself, with no
import cycle inside a room; imports inside functions count too (one that dodges a cycle is still a cycle). ROOMS is
the order, bottom first, written once here and drawn in docs/architecture.md ("Rooms"); the entry points, bench/,
scripts/ and tests/ stand above them all. The schedules' arithmetic imports no torch: the planner runs it without a
device."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROOMS = (  # bottom first; rooms on one floor do not import each other
    ("errors", "deepspeed_internals", "collectives"),  # leaves: what every room may use
    ("cluster",),      # the process group, its topology, files one rank writes for all
    ("schedules",),    # the pipeline schedules' orders, per-link programs and simulator: arithmetic, no torch
    ("models",),       # the model's math
    ("planner",),      # what a step costs, from the config alone
    ("checkpoints",),  # files on disk
    ("data",),         # datasets, collators, token shards, loaders
    ("engines",),      # the engines that run the schedules on DeepSpeed's pipeline, and what listens to them
    ("resilience",),   # keeping a run alive: supervisor, watchdog, stragglers, records, lease, preemption, exit codes
    ("evaluation",),   # the eval set, lm-eval's tasks, DPO's reference pass
    ("training",),     # the loop and its config
)
FLOOR = {room: floor for floor, rooms in enumerate(ROOMS) for room in rooms}
WITHOUT_TORCH = ("schedules",)


def imported_modules(path):
    """[(line, module)] of every absolute import in a source file, at any depth (functions included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def module_name(root, path):
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def house_violations(root, rooms=ROOMS, without_torch=WITHOUT_TORCH):
    """['file:line imports module (why)'] for every import that climbs, crosses a floor, or closes a cycle inside a
    room, and every room package missing from `rooms`."""
    floor = {room: i for i, names in enumerate(rooms) for room in names}
    packages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    violations = [f"{name}/ is a package but not a room of tests/test_rooms.py's ROOMS (give it a floor)"
                  for name in packages if name not in floor and name != "tests"]
    modules = {module_name(root, p): p for room in floor for p in sorted((root / room).rglob("*.py"))}
    edges = {}
    for name, path in modules.items():
        room = name.split(".")[0]
        for line, target in imported_modules(path):
            top = target.split(".")[0]
            where = f"{path.relative_to(root)}:{line} imports {target}"
            if room in without_torch and top in ("torch", "deepspeed"):
                violations.append(f"{where} (the schedules' arithmetic imports no torch)")
            if top not in floor or top == room:
                if top == room and target in modules and target != name:
                    edges.setdefault(name, set()).add(target)
                continue
            if floor[top] > floor[room]:
                violations.append(f"{where} (climbs: {top}/ is above {room}/)")
            elif floor[top] == floor[room]:
                violations.append(f"{where} (crosses: {top}/ and {room}/ share a floor)")
    violations += [f"import cycle inside a room: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return violations


def cycles(edges):
    """One cycle (its modules, the first repeated at the end) through each strongly connected group of edges."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return True
        if node in done:
            return False
        done.add(node)
        return any(visit(target, path + [node]) for target in sorted(edges.get(node, ())))
    for start in sorted(edges):
        visit(start, [])
    return found


def test_no_import_climbs_crosses_a_floor_or_closes_a_cycle():
    assert len(FLOOR) >= 12 and (ROOT / "training" / "loop.py").is_file()
    assert house_violations(ROOT) == []


@pytest.mark.parametrize("room, source, expected", [
    ("models", "from training.loop import run\n", "models/a.py:1 imports training.loop (climbs: training/ is above models/)"),
    ("models", "def f():\n    import planner.workload\n", "models/a.py:2 imports planner.workload (climbs"),
    ("collectives", "import errors\n", "collectives/a.py:1 imports errors (crosses"),
    ("schedules", "import torch\n", "schedules/a.py:1 imports torch (the schedules' arithmetic imports no torch)"),
    ("models", "def f():\n    from models.b import g\n", "import cycle inside a room: models.a -> models.b -> models.a"),
])
def test_the_check_finds_a_climb_a_crossing_torch_in_the_schedules_and_a_cycle(tmp_path, room, source, expected):
    """What guards the rule: each kind of violation, written in a house of two files, is found."""
    for name in {room, "models"}:
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / room / "a.py").write_text(source)
    (tmp_path / "models" / "b.py").write_text("import models.a\n" if "cycle" in expected else "")
    rooms = tuple(names for names in ROOMS if set(names) & {room, "models", "planner", "training", "errors"})
    found = house_violations(tmp_path, rooms)
    assert any(v.startswith(expected) for v in found), found
    (tmp_path / "newroom").mkdir()
    (tmp_path / "newroom" / "__init__.py").write_text("")
    assert "newroom/ is a package but not a room" in " ".join(house_violations(tmp_path, rooms))


def test_the_architecture_page_draws_the_rooms_in_this_order():
    """docs/architecture.md's drawing of the house (one floor a line, top floor first) is this order."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawing = page.split("```text\n", 1)[1].split("```", 1)[0]
    floors = [[word.strip("/") for word in line.split() if word.endswith("/")] for line in drawing.splitlines()]
    assert [tuple(f) for f in floors if f][::-1] == [tuple(names) for names in ROOMS]
