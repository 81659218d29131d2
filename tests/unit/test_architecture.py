"""The package structure (docs/extending.md, layout of the code): dependencies point one way, no two packages import
each other, and no two modules do, directly or around a loop; a model family's facts stay in its own package.

The graph is built from every import statement (at any depth, TYPE_CHECKING included) of every module in wanexp/, and
from every ``importlib.import_module("wanexp....")`` of a literal name; a module imported by a name computed at run
time is invisible to it, so only the one loader of configured class names may do that.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "wanexp"

# Which top-level units (wanexp/<pkg>/ or wanexp/<mod>.py) each unit may import. The order is the design's:
# errors <- config <- (models, objectives, data, parallel, adapters, perf, optim) <- module, callbacks <- memory_plan,
# composition <- train, cli.
ALLOWED = {
    "errors": set(),
    "text": set(),
    "config": {"errors", "runfolder"},  # runfolder is a leaf (errors only): check_paths reads a resume= file's bytes
    "perf": set(),
    "rng": set(),
    "gpu_check": {"errors"},  # whether the installed torch has kernels for this GPU (run start)
    "runfolder": {"errors"},
    "lightning_compat": set(),  # the one reader of Lightning's private parts
    "context": {"lightning_compat"},  # the run context (ranks, sp_size, log steps) handed to module, data, callbacks
    "adapters": {"errors"},
    "disk": {"errors", "adapters"},
    "optim": {"config"},
    "models": {"errors", "config", "perf", "text", "adapters"},  # adapters: a family's adapter naming
    "objectives": {"config", "errors", "adapters"},
    "data": {"errors", "config", "text", "context", "disk"},  # disk: a full disk while caching is one line
    "parallel": {"config", "errors"},
    "module": {"errors", "models", "objectives", "optim", "rng", "adapters", "context", "lightning_compat"},
    "generation": {"errors", "models", "data", "adapters", "objectives"},
    "callbacks": {"errors", "generation", "perf", "disk", "context", "lightning_compat", "models"},  # models: block swap
    "memory_plan": {"errors", "adapters"},  # the fit estimate and blocks_to_swap=auto, from the family's formula
    # the builders and the pre-flight every command shares (train, plan, cache, the benches)
    "composition": {"errors", "config", "models", "callbacks", "runfolder", "disk", "gpu_check", "parallel",
                    "memory_plan"},
    "train": {"errors", "config", "composition", "module", "optim", "callbacks", "runfolder", "disk", "context",
              "data"},  # data: the prompts-only check
    # train: wanexp-plan's calibration is a training run (its one use of the training entry, not of its builders)
    "cli": {"errors", "config", "data", "models", "module", "perf", "composition", "train", "generation", "adapters",
            "context", "callbacks", "disk", "runfolder"},  # callbacks, disk: wanexp-plan's timer and disk estimate
}


def string_import(node: ast.AST) -> str | None:
    """The module a call imports by a literal name (``importlib.import_module("x.y")``, ``import_module("x.y")``,
    ``__import__("x.y")``), else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    arg = node.args[0]
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def dynamic_imports(tree: ast.AST) -> list[int]:
    """The lines of the calls that import a module by a name computed at run time (no literal: unseen by the graph)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and string_import(n) is None
            and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in ("import_module", "__import__")]


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
            elif string_import(node):
                names = [string_import(node)]
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
    assert not extra, f"wanexp.{unit} imports {sorted(extra)}, against the dependency direction (ALLOWED)"


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


# ---- module level: no two modules import each other, directly or around a loop --------------------------------------
def _module_name(f: Path, root: Path = ROOT) -> str:
    parts = (root.name, *f.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # one parse of the package for the tests below
def module_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the package at ``root`` it imports, from every import statement at any depth (inside
    functions too: a lazy import only moves the cycle's failure to the first call) and every import of a literal
    name (``importlib.import_module("wanexp.x")``). ``from pkg import name`` counts as an import of the module
    ``pkg.name`` when that is a module, else of ``pkg``."""
    files = {_module_name(f, root): f for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    pkg = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join([*pkg, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif string_import(node):
                targets = [string_import(node)]
            else:
                continue
            deps |= {t for t in targets if t in files and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(v, path):
        state[v] = 1
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w, path + [w])
                if found:
                    return found
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v, [v])
            if found:
                return found
    return None


def test_no_module_level_import_cycle():
    cycle = find_cycle(module_imports())
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = module_imports()  # the graph holds function-level imports: WanSpec's lazy import of the conversion
    assert "wanexp.models.wan22.original" in graph["wanexp.models.wan22.spec"]


def test_the_graph_sees_a_module_imported_by_its_name(tmp_path):
    pkg = tmp_path / "wanexp"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py", "sub/b.py", "c.py", "d.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("import importlib\n\ndef load():\n    return importlib.import_module('wanexp.sub.b')\n")
    (pkg / "c.py").write_text("from importlib import import_module\nx = import_module('wanexp.d')\n")
    graph = module_imports(pkg)
    assert graph["wanexp.a"] == {"wanexp.sub.b"} and graph["wanexp.c"] == {"wanexp.d"}


def test_only_the_class_loader_imports_a_computed_module_name():
    """A module imported by a name computed at run time is no edge of the graphs above: the one place that does it is
    wanexp.models.family.load_class (a config's dotted class name); everything else imports by a literal name or
    asks load_class."""
    found = {f"{f.relative_to(ROOT.parent)}:{line}" for f in ROOT.rglob("*.py")
             for line in dynamic_imports(ast.parse(f.read_text()))}
    tree = ast.parse((ROOT / "models" / "family.py").read_text())
    loader = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_class")
    allowed = {f"wanexp/models/family.py:{line}" for line in dynamic_imports(loader)}
    assert allowed, "wanexp.models.family.load_class no longer imports by name: update this rule"
    assert found == allowed, f"modules imported by a computed name outside load_class: {sorted(found - allowed)}"


# ---- a model family's facts stay in its package ---------------------------------------------------------------------
FAMILY = ROOT / "models" / "wan22"
# Names that are Wan2.2's alone (its diffusers module and class names, its folders, its VAE's constants, its frame
# rule, its original and kohya key names): shared code asks the family's spec (wanexp.models.family.ModelSpec) instead.
WAN_ONLY = ("attn1", "attn2", "to_q", "to_k", "to_v", "to_out", "ffn.net", "transformer_2", "EXPERT_FOLDERS",
            "WanTransformer3DModel", "AutoencoderKLWan", "UMT5", "latents_mean", "latents_std", "4k+1", "WanPipeline",
            "WanImageToVideoPipeline", "self_attn", "cross_attn", "lora_unet_blocks")
# a name is found where no letter or digit touches its start (``blocks.0.attn1``, ``_self_attn_q``, ``UMT5Encoder``);
# a short module name also not its end (``to_q`` is not ``to_quantize``)
_SHORT = {"attn1", "attn2", "to_q", "to_k", "to_v", "to_out"}
WAN_NAME = re.compile("|".join(rf"(?<![A-Za-z0-9])({re.escape(n)}){'(?![A-Za-z0-9])' if n in _SHORT else ''}"
                               for n in WAN_ONLY))


def wan_only_names(text: str) -> list[tuple[int, str]]:
    """(line, name) of every Wan-only name in a file's text: code, strings, docstrings and comments alike."""
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in WAN_NAME.finditer(text)]


def test_the_name_rule_reads_code_and_prose():
    text = ('"""Loads UMT5EncoderModel; Wan2.2 prose and the word Wan are fine."""\n'
            'x = m.blocks[0].attn1.to_q  # a to_quantize() is not to_q\nkey = "lora_unet_blocks_0_self_attn_q"\n')
    assert wan_only_names(text) == [(1, "UMT5"), (2, "attn1"), (2, "to_q"), (2, "to_q"), (3, "lora_unet_blocks"),
                                    (3, "self_attn")]


def test_no_wan_only_name_outside_the_wan_family():
    """Shared code never names a Wan2.2 fact (docs/extending.md, adding a model family): a second family would
    inherit it. The family's package (wanexp/models/wan22/) says them; everything else asks the spec."""
    found = [f"{f.relative_to(ROOT.parent)}:{line}: {name}" for f in sorted(ROOT.rglob("*.py"))
             if FAMILY not in f.parents for line, name in wan_only_names(f.read_text())]
    assert not found, f"{len(found)} Wan-only name(s) outside wanexp/models/wan22/:\n" + "\n".join(found[:40])
