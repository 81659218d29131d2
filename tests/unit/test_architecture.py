"""The package structure of ../shared/design.md: dependencies point one way and no two packages import each other.

The graph is built from every import statement (at any depth, TYPE_CHECKING included) of every module in wanexp/.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "wanexp"

# Which top-level units (wanexp/<pkg>/ or wanexp/<mod>.py) each unit may import. The order is the design's:
# errors <- config <- (models, objectives, data, parallel, lora, perf, optim) <- module, callbacks <- train, cli.
ALLOWED = {
    "errors": set(),
    "text": set(),
    "config": {"errors", "runfolder"},  # runfolder is a leaf (errors only): check_paths reads a resume= file's bytes
    "perf": set(),
    "rng": set(),
    "runfolder": {"errors"},
    "lora": {"errors"},
    "disk": {"errors", "lora"},
    "optim": {"config"},
    "models": {"errors", "config", "perf", "text"},
    "objectives": {"config", "errors", "lora"},
    "data": {"errors", "config", "text"},
    "parallel": {"config", "errors"},
    "module": {"errors", "models", "objectives", "optim", "rng", "lora"},
    "sampling": {"errors", "models", "data", "lora", "objectives"},
    "callbacks": {"errors", "sampling", "perf", "disk"},
    "train": {"errors", "config", "models", "module", "optim", "callbacks", "runfolder", "disk"},
    "cli": {"errors", "config", "data", "models", "module", "perf", "train", "sampling"},
}


def unit_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    units = {p.stem for p in ROOT.iterdir() if (p.suffix == ".py" and p.stem != "__init__") or
             (p.is_dir() and (p / "__init__.py").exists())}
    for f in ROOT.rglob("*.py"):
        unit = f.relative_to(ROOT).parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        deps = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                parts = n.split(".")
                if parts[0] == "wanexp" and len(parts) > 1 and parts[1] in units and parts[1] != unit:
                    deps.add(parts[1])
    return graph


def test_every_unit_is_placed_in_the_design():
    assert set(unit_imports()) == set(ALLOWED)


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_imports_point_one_way(unit):
    extra = unit_imports()[unit] - ALLOWED[unit]
    assert not extra, f"wanexp.{unit} imports {sorted(extra)}, against the dependency direction of design.md"


def test_no_cycles():
    graph = unit_imports()
    state: dict[str, int] = {}

    def visit(v, path):
        state[v] = 1
        for w in graph[v]:
            assert state.get(w) != 1, "import cycle: " + " -> ".join(path + [w])
            if w not in state:
                visit(w, path + [w])
        state[v] = 2

    for v in graph:
        if v not in state:
            visit(v, [v])


def test_errors_is_a_leaf_and_config_imports_no_heavy_package():
    for f in (ROOT / "errors.py", *(ROOT / "config").glob("*.py")):
        tree = ast.parse(f.read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not top & {"torch", "lightning", "diffusers", "transformers", "peft"}, f
        if f.name == "errors.py":
            assert "wanexp" not in top


def test_nothing_is_unpickled():
    """Every torch.load in the package reads with weights_only=True, and fit loads checkpoints the same way."""
    calls = []
    for f in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("load", "fit"):
                owner = node.func.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name in ("torch", "trainer"):
                    kw = {k.arg: k.value for k in node.keywords}
                    ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                    calls.append((f"{f.name}:{node.lineno}", ok))
    assert calls and all(ok for _, ok in calls), [c for c, ok in calls if not ok]
