"""Shared fixtures: compose configs like the CLI does; tiny models and demo clips built once per session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from wanexp.config import CONF_DIR as CONF
from wanexp.config import compose

ROOT = Path(__file__).resolve().parents[1]


def one_thread_per_process() -> None:
    """Tiny models, two pytest-xdist workers on a 2-core machine: one intra-op thread in each worker and in every run
    it starts (OMP_NUM_THREADS is inherited). A second thread only spins against the other worker's: a 6-step
    ``python train.py`` of the demo took 40 s of CPU with 2 threads, 20 s with 1. A value set by the caller stays."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


one_thread_per_process()


def pytest_collection_modifyitems(config, items) -> None:
    """The modules that hold slow (multi-process, end-to-end) tests run first, each module's tests together and in
    their order. ``make test`` hands the two xdist workers 2 tests at a time (``--maxschedchunk 2``): both start on
    the long runs and both end on short tests (longest first), instead of one worker finishing a minute-long run
    alone (with larger chunks or ``--dist worksteal`` the slow modules landed on one worker and ran last)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order inside each group stays


def compose_cfg(overrides: list[str]) -> DictConfig:
    return compose(overrides)


def module_from(cfg: DictConfig):
    """The DiffusionModule ``cfg`` makes, as train.py builds it but without encoders, on its model folder (the tiny
    model written there first where it is missing); not configured yet (``configure_model`` loads the transformers)."""
    from wanexp.composition import build
    from wanexp.models.tiny import ensure_tiny_model
    from wanexp.module import DiffusionModule

    spec = build(cfg.model)
    ensure_tiny_model(spec)
    o = cfg.optim
    return DiffusionModule(spec, build(cfg.adapter), build(cfg.objective), cfg.boundary, optimizer=build(o.optimizer),
                           lr=o.lr, schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")},
                           load_encoders=False)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """Tiny models and generated clips, built once per test session (never in the repo) for every xdist worker: the
    first run that needs one builds it; both builders build aside and rename into place, so a worker that races
    another uses the winner's (wanexp/models/tiny.py, wanexp/data/synthetic.py)."""
    folder = session_dir(tmp_path_factory) / "wanexp_shared"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def _hydra_full_error_as_found():
    """A command's main run in the test's process (wanexp.composition.hydra_main) sets HYDRA_FULL_ERROR for Hydra:
    unset again after the test, so the commands later tests start in subprocesses keep their one-line errors."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    yield
    if before is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = before


@pytest.fixture(scope="session", autouse=True)
def _tiny_models_outside_the_repo(shared_dir) -> None:
    """A test that composes ``experiment=demo`` without ``paths.tiny_model_dir`` (and every run it starts) finds and
    builds the tiny models in the session's shared folder: never in the checkout's outputs/, and never a model some
    earlier test or ``make demo`` happened to leave there. A value set by the caller stays."""
    os.environ.setdefault("WANEXP_TINY_DIR", str(shared_dir / "models"))


@pytest.fixture
def tiny_overrides(shared_dir, tmp_path) -> list[str]:
    """Overrides for a fast CPU run of the tiny model on the synthetic clips, writing into tmp_path."""
    return [
        "experiment=demo",
        f"paths.tiny_model_dir={shared_dir}/models",
        f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={tmp_path}/run",
        "trainer.max_steps=3",
        "callbacks.checkpoint.every_n_train_steps=2",
        "trainer.log_every_n_steps=1",
        "callbacks.progress=null",
    ]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py ARGS`` as a user would."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


# One fresh process for many refused commands: each is ``python train.py ARGS``'s entry (wanexp.train.main) with its
# own argv, environment, stdout and stderr, and warnings shown anew; then the Lightning modules imported so far.
_BATCH = r"""
import contextlib, io, json, os, sys, time, warnings
from hydra.core.global_hydra import GlobalHydra
from wanexp.train import main
commands, record = sys.argv[1:3]
results, environ = [], dict(os.environ)
for args in json.load(open(commands)):
    os.environ.clear()
    os.environ.update(environ)  # main sets HYDRA_FULL_ERROR, a run its parallel.env: each command starts without
    out, err, code, t0 = io.StringIO(), io.StringIO(), 0, time.perf_counter()
    sys.argv = ["train.py", *args]
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback
            traceback.print_exc()
            code = "raised"
    GlobalHydra.instance().clear()
    results.append({"args": args, "returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "seconds": time.perf_counter() - t0,
                    "lightning": sorted(m for m in sys.modules if m.split(".")[0] == "lightning")})
json.dump(results, open(record, "w"))
"""


def run_cli_batch(commands: list[list[str]], folder: Path, timeout: float = 300, env: dict | None = None) -> list[dict]:
    """Run each ``python train.py ARGS`` of ``commands`` in one new process, in order (a process's imports cost ~8 s
    here, a refused command well under one): per command its ``returncode`` (SystemExit's code), ``stdout``,
    ``stderr`` and ``lightning`` (the Lightning modules imported by then). Whatever the process writes outside the
    commands (at import) is in the result's ``outside``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "commands.json").write_text(json.dumps(commands))
    res = subprocess.run([sys.executable, "-c", _BATCH, str(folder / "commands.json"), str(folder / "results.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((folder / "results.json").read_text())
    for r in results:
        r["outside"] = res.stdout + res.stderr
    (folder / "results.json").write_text(json.dumps(results))
    return results


def session_dir(tmp_path_factory) -> Path:
    """A folder of this test session that every pytest-xdist worker sees (a worker's own base folder otherwise)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
