"""docs/extending.md's "Adding an objective", followed literally: its module and YAML blocks are written to the
files their first lines name, its training command trains the tiny model in-process, and each error line it shows is
the line the checks give for its command."""
from __future__ import annotations

import csv
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose_cfg
from tests.integration.conftest import tiny_run
from wanexp.config import check_config
from wanexp.errors import ConfigError

PAGE = ROOT / "docs" / "extending.md"
COMMAND = "PYTHONPATH=. python train.py "


def section() -> str:
    text = PAGE.read_text()
    start = text.index("## Adding an objective\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(lang: str) -> list[str]:
    found = re.findall(rf"^```{lang}\n(.*?)^```", section(), flags=re.M | re.S)
    assert found, f"the section has no {lang} block"
    return found


def args_of(command: str, folder: Path) -> list[str]:
    """The overrides of one ``python train.py`` line, run from ``folder`` ($PWD)."""
    assert command.startswith(COMMAND), command
    return shlex.split(command[len(COMMAND):].replace("$PWD", str(folder)))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The folder the page's files are written into, named by each block's first line (a comment), and run from:
    its packages importable, as PYTHONPATH=. makes them."""
    packages = set()
    for lang in ("python", "yaml"):
        for body in blocks(lang):
            name = body.splitlines()[0].lstrip("#").strip()
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            if lang == "python":
                (path.parent / "__init__.py").touch()
                packages.add(Path(name).parts[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:  # the next test imports its own copy
        del sys.modules[name]


def test_the_pages_objective_trains_the_tiny_model(shared_dir, folder):
    (command,) = [line for line in blocks("bash")[0].splitlines() if line.startswith(COMMAND)]
    args = args_of(command, folder)
    assert "experiment=demo" in args  # tiny_run composes the demo experiment itself
    r = tiny_run(shared_dir, folder / "run", [a for a in args if a != "experiment=demo"] + ["trainer.max_steps=2"])
    objective = r["module"].objective
    target = yaml.safe_load(blocks("yaml")[0])["_target_"]
    assert f"{type(objective).__module__}.{type(objective).__name__}" == target
    assert OmegaConf.get_type(r["cfg"].objective) is type(objective).schema  # typed by the class's schema
    assert r["global_step"] == 2
    rows = list(csv.DictReader(open(Path(r["output_dir"]) / "logs" / "version_0" / "metrics.csv")))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert losses and all(math.isfinite(v) for v in losses)
    assert (Path(r["output_dir"]) / "lora" / "final" / "tiny_lora_comfyui.safetensors").is_file()


def test_the_pages_error_lines_are_what_the_checks_say(folder):
    lines = blocks("text")[0].splitlines()
    examples = [(lines[i][2:], lines[i + 1]) for i in range(len(lines) - 1) if lines[i].startswith("$ ")]
    assert len(examples) >= 2  # a value the schema refuses, and one the objective's own check refuses
    for command, shown in examples:
        with pytest.raises(ConfigError) as e:
            check_config(compose_cfg(args_of(command, folder)))
        assert "\n" not in str(e.value) and f"wanexp: error: {e.value}" == shown
