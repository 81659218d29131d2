"""The package structure (docs/extending.md, layout of the code): dependencies point one way, no two packages import
each other, and no two modules do, directly or around a loop.

The graph is built from every import statement (at any depth, TYPE_CHECKING included) of every module in wanexp/.
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
    "models": {"errors", "config", "perf", "text", "adapters", "gpu_check", "data", "objectives"},  # adapters: a
    # family's adapter naming; gpu_check: a kernel's compute capability (the FP8 GEMM, compiled blocks); data: a family
    # reading its sample inputs' media (S2V's audio: wanexp.data.audio); objectives: the demo build's base trained by
    # flow matching (wanexp.models.wan22.pretrain; objectives import no model code)
    "objectives": {"config", "errors", "adapters"},
    "data": {"errors", "config", "text", "context", "disk"},  # disk: a full disk while caching is one line
    "parallel": {"config", "errors", "models"},  # models: the sequence groups generation on several ranks uses
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
            "context", "callbacks", "disk", "runfolder", "parallel"},  # callbacks, disk: wanexp-plan's timer and disk
    # estimate; parallel: wanexp-sample's processes
}


def string_imports(node) -> list[str]:
    """The module a call imports by name: ``importlib.import_module("wanexp.x")``, ``import_module(...)``,
    ``__import__(...)`` and hydra's ``get_class("wanexp.x.Class")``/``get_method`` with a literal name (a dynamic
    import is an import too: it must point the same way)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return []
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    if name in ("import_module", "__import__"):
        return [node.args[0].value]
    if name in ("get_class", "get_method", "load_class"):
        return [node.args[0].value.rpartition(".")[0]]
    return []


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
            else:
                names = string_imports(node)
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
def _module_name(f: Path) -> str:
    parts = ("wanexp", *f.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # one parse of the package for the tests below
def module_imports() -> dict[str, set[str]]:
    """Module -> the wanexp modules it imports, from every import statement at any depth (inside functions too: a
    lazy import only moves the cycle's failure to the first call). ``from pkg import name`` counts as an import of
    the module ``pkg.name`` when that is a module, else of ``pkg``."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}
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
            else:
                targets = string_imports(node)
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


# ---- the model-family seam: a family's facts live in its folder ----------------------------------------------------
# Names only Wan2.2 has (its diffusers module names, its second expert's folder, its components and pipelines, its
# original release's key names, its frame rule): shared code asks the family's spec instead (docs/extending.md). A
# family's own folder (models/wan22, models/s2v: the S2V DiT is built of Wan blocks) may name them.
WAN_ONLY = re.compile(r"\battn[12]\b|\bto_[qkv]\b|\bto_out\b|ffn\.net|\btransformer_2\b|EXPERT_FOLDERS|"
                      r"WanTransformer3DModel|AutoencoderKLWan|UMT5|latents_(mean|std)|4k\+1|WanPipeline|"
                      r"WanImageToVideoPipeline|\b(self|cross)_attn\b|lora_unet_blocks")


def wan_only_names(root: Path = ROOT) -> list[str]:
    """Each line of the package outside its Wan2.2 folder that names a Wan-only fact (code and docstrings alike)."""
    found = []
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root).parts
        if parts[0] == "models" and len(parts) > 2:  # in a family's folder
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if WAN_ONLY.search(line):
                found.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    return found


def test_wan22_facts_live_in_its_family_folder():
    found = wan_only_names()
    assert not found, "Wan-only names outside wanexp/models/wan22/ (ask the family's spec):\n" + "\n".join(found)


def test_the_rule_sees_a_wan_name_in_a_shared_file(tmp_path):
    (tmp_path / "models" / "wan22").mkdir(parents=True)
    (tmp_path / "models" / "wan22" / "spec.py").write_text("folders = {'low': 'transformer_2'}\n")
    (tmp_path / "lora.py").write_text('TARGETS = ["to_q"]  # fine in wan22, not here\n')
    (tmp_path / "models" / "family.py").write_text("SELF = 'attn1'\n")  # models/, but no family's folder
    assert wan_only_names(tmp_path) == ["lora.py:1: TARGETS = [\"to_q\"]  # fine in wan22, not here",
                                        "models/family.py:1: SELF = 'attn1'"]


def test_a_string_import_is_an_import():
    """``importlib.import_module("wanexp.x")`` and hydra's ``get_class("wanexp.x.C")`` count in both graphs."""
    calls = ast.parse('importlib.import_module("wanexp.module")\nget_class("wanexp.models.family.ModelSpec")\n'
                      'load_class(name)\nprint("wanexp.disk")')
    assert [t for node in ast.walk(calls) for t in string_imports(node)] == ["wanexp.module", "wanexp.models.family"]


def test_cli_uses_train_only_to_run_training():
    """The commands share their builders and pre-flight through wanexp.composition; the one import of wanexp.train
    in cli/ is wanexp-plan's calibration, which is a training run."""
    users = sorted(m for m, deps in module_imports().items() if m.startswith("wanexp.cli.") and "wanexp.train" in deps)
    assert users == ["wanexp.cli.plan"], users


def computed_imports(tree: ast.AST) -> list[int]:
    """The lines of the calls that import a module by a name computed at run time (``import_module(name)``,
    ``__import__(name)``): an edge neither graph can see."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and not string_imports(n)
            and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in ("import_module", "__import__")]


def test_only_the_class_loader_imports_a_computed_name():
    """One function imports a module by a computed name: wanexp.models.family.load_class, the loader of a config's
    dotted class names (hydra's get_class does the same for a ``_target_``); any other module imports by a literal
    name, which the graphs above see."""
    found = {f"{f.relative_to(ROOT.parent)}:{line}" for f in ROOT.rglob("*.py")
             for line in computed_imports(ast.parse(f.read_text()))}
    tree = ast.parse((ROOT / "models" / "family.py").read_text())
    loader = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "load_class")
    allowed = {f"wanexp/models/family.py:{line}" for line in computed_imports(loader)}
    assert allowed, "wanexp.models.family.load_class no longer imports by a computed name: update this rule"
    assert found == allowed, f"modules imported by a computed name outside load_class: {sorted(found - allowed)}"
