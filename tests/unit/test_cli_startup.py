"""The commands answer bad input with one line and exit 2 before any model is read."""
from __future__ import annotations

import sys

import pytest


def test_bench_with_a_missing_model_folder_is_one_line(tmp_path, monkeypatch, capsys):
    from wanexp.cli import bench

    monkeypatch.setattr(sys, "argv", ["wanexp-bench", "--model-path", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as e:
        bench.entry()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err == [f"wanexp: error: --model-path {tmp_path / 'nowhere'}: no transformer/config.json there; point it "
                   "at a local diffusers-format ti2v5b folder"]


# Each command's entry point, its arguments, the exit code and what the first line of its output starts with.
LIGHT = [
    ("wanexp.train:main", ["--help"], 0, "usage: python train.py"),
    ("wanexp.cli.cache:main", ["--help"], 0, "usage: "),
    ("wanexp.cli.plan:main", ["--help"], 0, "wanexp-plan options"),
    ("wanexp.cli.sample:entry", ["--help"], 0, "usage: python -m wanexp.cli.sample"),
    ("wanexp.cli.status:main", ["--help"], 0, "usage: wanexp-status"),
    ("wanexp.cli.merge:entry", ["--help"], 0, "usage: wanexp-merge"),
    ("wanexp.train:main", ["optim.lr=abc"], 2, "wanexp: error: optim.lr=abc: must be a number"),
    ("wanexp.cli.cache:main", ["optim.lr=abc"], 2, "wanexp: error: optim.lr=abc: must be a number"),
    ("wanexp.cli.plan:main", ["optim.lr=abc"], 2, "wanexp: error: optim.lr=abc: must be a number"),
    ("wanexp.train:main", ["model.path=/nowhere"], 2, "wanexp: error: model.path=/nowhere: folder not found"),
    ("wanexp.cli.cache:main", ["model.path=/nowhere"], 2, "wanexp: error: model.path=/nowhere: folder not found"),
    ("wanexp.cli.plan:main", ["model.path=/nowhere"], 2, "wanexp: error: model.path=/nowhere: folder not found"),
    ("wanexp.cli.sample:entry", ["--run", "/nowhere", "--prompt", "x"], 2, "wanexp: error: --run /nowhere: no "
                                                                           "config.yaml there"),
]

_PROBE = r"""
import importlib, json, sys
module, _, name = sys.argv[1].partition(":")
sys.argv = [sys.argv[1], *json.loads(sys.argv[2])]
code = 0
try:
    code = getattr(importlib.import_module(module), name)()  # a console script exits with what its entry returns
    code = code if type(code) is int else 0
except SystemExit as e:
    code = e.code or 0
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "lightning", "peft") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def test_help_and_bad_input_answer_before_torch_is_imported():
    """``--help`` and a refused argument are answered without importing torch, diffusers, transformers, Lightning or
    peft (each would cost seconds on a 2-core machine before the one line)."""
    import json
    import subprocess

    from tests.conftest import ROOT

    wrong = []
    for entry, args, code, first in LIGHT:
        r = subprocess.run([sys.executable, "-c", _PROBE, entry, json.dumps(args)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        res = json.loads(lines[-1])
        out = (r.stdout.strip() or "\n".join(lines[:-1])).splitlines()
        if res != {"code": code, "heavy": []} or not (out and out[0].startswith(first)):
            wrong.append(f"{entry} {' '.join(args)}: {res}, first line {out[:1]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("entry, args, says", [
    ("wanexp.cli.plan:main", ["--budget-gib=x"], "--budget-gib='x': must be a number"),
    ("wanexp.cli.sample:entry", ["--run", "/nowhere", "--prompt", "x"], "--run /nowhere: no config.yaml there"),
    ("wanexp.cli.merge:entry", ["bake", "--model", "/nowhere", "--lora", "/nowhere.safetensors", "--out", "/o"],
     "/nowhere"),
    ("wanexp.cli.status:main", ["/nowhere"], "/nowhere"),
])
def test_a_commands_own_refusal_is_torchruns_root_cause_too(tmp_path, entry, args, says):
    """Each command's own refusal (not only train.py's config checks) goes through wanexp.errors.say_error: the line
    on stderr and, under torchrun, in the rank's error file that torchrun reports as the root cause."""
    import json
    import os
    import subprocess

    from tests.conftest import ROOT

    error_file = tmp_path / "error.json"
    r = subprocess.run([sys.executable, "-c", _PROBE, entry, json.dumps(args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file)))
    line = r.stderr.strip().splitlines()[0]
    assert json.loads(r.stderr.strip().splitlines()[-1])["code"] == 2 and line.startswith("wanexp: error: ")
    assert says in line, line
    assert json.loads(error_file.read_text())["message"]["message"] == line.removeprefix("wanexp: error: ")
