"""Objectives carry their own rules and schema, and wanexp.objectives.base.Objective is exactly what the rest of wanexp
uses: the module's call, the attributes it and the callbacks read, every objective's signature."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re

import pytest
from omegaconf import OmegaConf

import wanexp.objectives
from tests.conftest import ROOT, compose_cfg
from wanexp.config import check_config
from wanexp.errors import ConfigError
from wanexp.objectives.base import Objective

# where an objective is used through its interface (the module, the run, the callbacks, the disk estimate)
USERS = ["wanexp/module.py", "wanexp/train.py", "wanexp/disk.py", *sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "wanexp" / "callbacks").glob("*.py"))]


def objective_classes() -> list[type]:
    """Every Objective subclass in wanexp/objectives/ and the tests' own."""
    for info in pkgutil.iter_modules(wanexp.objectives.__path__):
        importlib.import_module(f"wanexp.objectives.{info.name}")
    importlib.import_module("tests.helpers")
    found, todo = [], [Objective]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def objective_calls(path: str) -> list[ast.Call]:
    tree = ast.parse((ROOT / path).read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "objective" and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]


def test_the_module_calls_an_objective_with_the_base_interface():
    calls = objective_calls("wanexp/module.py")
    assert calls, "no self.objective(...) call found in wanexp/module.py"
    base = inspect.signature(Objective.__call__)
    keyword_only = {n for n, p in base.parameters.items() if p.kind is p.KEYWORD_ONLY}
    for call in calls:
        passed = {k.arg for k in call.keywords}
        # every call passes what the interface declares, and nothing else
        assert passed == keyword_only, (ast.unparse(call), keyword_only)
        base.bind(None, *call.args, **{k: None for k in passed})


def test_every_objective_takes_the_base_call():
    base = [(p.name, p.kind, p.default) for p in inspect.signature(Objective.__call__).parameters.values()]
    classes = objective_classes()
    assert {"FlowMatching", "KnowledgeDistillation", "DMD", "CleanLatentObjective"} <= {c.__name__ for c in classes}
    for cls in classes:
        own = [(p.name, p.kind, p.default) for p in inspect.signature(cls.__call__).parameters.values()]
        assert own == base, f"{cls.__qualname__}.__call__ differs from Objective.__call__"


def test_every_attribute_used_of_an_objective_is_on_the_base():
    used = set()
    for path in USERS:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            holder = node.value if isinstance(node, ast.Attribute) else None
            named = (isinstance(holder, ast.Attribute) and holder.attr == "objective" and
                     not (isinstance(holder.value, ast.Name) and holder.value.id == "cfg")) or \
                (isinstance(holder, ast.Name) and holder.id == "objective")
            if named:
                used.add((path, node.attr))
    assert {a for _, a in used} >= {"adapters", "phase", "export", "needs_negative_text"}, used
    base = Objective("x")
    missing = sorted(f"{path}: objective.{a}" for path, a in used if not hasattr(base, a))
    assert not missing, "used but not declared in wanexp/objectives/base.py:\n" + "\n".join(missing)


def test_config_rules_name_no_objective():
    text = (ROOT / "wanexp" / "config" / "rules.py").read_text()
    names = [c.schema().name for c in objective_classes() if c.schema is not None and c.__module__.startswith("wanexp")]
    assert set(names) >= {"flow_matching", "dmd", "kd"}
    found = [n for n in names if re.search(rf"\b{n}\b", text)]
    assert not found, f"wanexp/config/rules.py names objectives {found}: their rules belong in their check()"


def test_each_objective_brings_its_schema():
    for name in ("flow_matching", "dmd", "kd"):
        cfg = compose_cfg(["model.path=/m", f"objective={name}"])
        cls = importlib.import_module(cfg.objective._target_.rpartition(".")[0])
        cls = getattr(cls, cfg.objective._target_.rpartition(".")[2])
        assert OmegaConf.get_type(cfg.objective) is cls.schema


OBJECTIVE_RULES = [
    (["objective=dmd", "trainer.accumulate_grad_batches=2"],
     "objective=dmd with trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=1"),
    (["objective=dmd", "trainer.accelerator=gpu", "trainer.precision=16-mixed", "model.dtype=fp16"],
     "objective=dmd with trainer.precision=16-mixed", "bf16-mixed"),
    (["objective=kd", "model.compile=false", "model.blocks_to_swap=2"],
     "model.blocks_to_swap=2 with objective=kd",
     "model.blocks_to_swap=0"),
    (["objective._target_=nowhere_pkg.Objective"], "objective._target_=nowhere_pkg.Objective: cannot import it",
     "objective=<name>"),
    (["objective._target_=collections.OrderedDict"], "objective._target_=collections.OrderedDict: not an objective",
     "wanexp.objectives.base.Objective"),
]


@pytest.mark.parametrize("overrides,key,fix", OBJECTIVE_RULES, ids=[" ".join(r[0]) for r in OBJECTIVE_RULES])
def test_an_objectives_rule_is_one_line(overrides, key, fix):
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["model.path=/m", *overrides]))
    msg = str(e.value)
    assert msg.startswith(key) and fix in msg and "\n" not in msg, msg


@pytest.mark.parametrize("extra,message", [
    ({"nan_loss_at": [2], "timestepp": 1}, "objective.timestepp: no such key in FaultyFlowMatchingConfig"),
    ({"nan_loss_at": "abc"}, "objective.nan_loss_at"),
    ({"nan_loss_at": [2], "timestep": {"sampling": "beta"}}, "objective.timestep.sampling=beta: allowed values"),
])
def test_an_objective_typed_by_its_class_refuses_bad_values_in_one_line(extra, message):
    """An objective's YAML that no ConfigStore schema typed (one from outside wanexp) is typed by its class's schema."""
    cfg = compose_cfg(["model.path=/m"])
    group = OmegaConf.create({**OmegaConf.to_container(cfg.objective), "_target_": "tests.helpers.FaultyFlowMatching"})
    cfg.objective = OmegaConf.to_container(OmegaConf.merge(group, extra))
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    cfg.objective = OmegaConf.to_container(OmegaConf.merge(group, {"nan_loss_at": [2]}))
    check_config(cfg)
    assert type(cfg.objective.nan_grad_at) is not list and list(cfg.objective.nan_grad_at) == []  # the schema's default


def test_an_unset_field_of_an_objective_typed_by_its_class_is_one_line():
    cfg = compose_cfg(["model.path=/m"])
    group = {**OmegaConf.to_container(cfg.objective), "_target_": "tests.helpers.FaultyFlowMatching"}
    del group["timestep"]["logit_mean"]  # TimestepConfig has no default for it
    cfg.objective = group
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value).startswith("objective.timestep.logit_mean is not set") and "\n" not in str(e.value)
