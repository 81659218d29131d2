"""The live run page in a real headless browser (Debian's chromium through Playwright, tests/browser.py) while a tiny
run trains: the page loads, follows the run as it goes, and shows what status.json and the run folder hold."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import pytest
import yaml

from tests import browser
from tests.conftest import ROOT
from wanexp.cli.status_server import make_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(browser.missing() is not None, reason=f"no browser test: {browser.missing()}")]

STEPS = 80  # the page, polling every 0.25 s, sees the step move while the run trains (0.02-0.1 s a step)


def test_the_page_follows_a_training_run_and_shows_its_status(shared_dir, tmp_path):
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    run = outputs / "live"
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
         f"paths.data_dir={shared_dir}/data", f"paths.output_dir={run}", "data.max_samples=2",
         f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=10", "callbacks.status.every_s=0.1",
         "callbacks.progress=null", f"callbacks.checkpoint.every_n_train_steps={STEPS}",
         f"callbacks.validation.every_n_steps={STEPS}", "callbacks.validation.steps=2"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    server = make_server(outputs, port=0, token="t0ken", every_s=0.25)  # the token: media URLs carry it too
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    card = "section.run[data-run='live']"

    def field(p, name: str) -> str:
        return p.inner_text(f"{card} [data-field={name}]")

    def shown(name: str) -> str:  # the same, as a JavaScript expression for wait_for_function
        return f"document.querySelector(\"{card} [data-field={name}]\")?.textContent"

    try:
        with browser.page() as p:
            p.goto(server.url)
            assert p.inner_text("h1") == "wanexp runs"
            wait = 240_000  # ms; a bound for a busy machine, not a measure
            p.wait_for_function(f"() => {shown('state')} === 'running' && +{shown('step')} > 0", timeout=wait)
            first = int(field(p, "step"))
            assert first < STEPS
            # the page moves on by itself while the run trains
            p.wait_for_function(f"() => {shown('state')} === 'running' && +{shown('step')} > {first}", timeout=wait)
            assert proc.wait(timeout=wait / 1000) == 0, (tmp_path / "train.log").read_text()[-3000:]
            p.wait_for_function(f"() => {shown('state')} === 'finished' && "
                                f"document.querySelectorAll(\"{card} figure.video\").length === 4", timeout=wait)
            # the numbers equal status.json's
            status = json.loads((run / "status.json").read_text())
            assert status["step"] == STEPS
            assert (field(p, "step"), field(p, "total")) == (str(status["step"]), str(status["total_steps"]))
            assert math.isclose(float(field(p, "loss")), status["loss"], rel_tol=1e-3)  # 4 significant digits
            assert math.isclose(float(field(p, "lr")), status["lr"], rel_tol=1e-2)  # 3
            assert f"{STEPS} / {STEPS} (100.0 %)" in field(p, "progress")
            row = p.inner_text("#runs tr[data-run='live']")
            assert f"{STEPS} / {STEPS}" in row and field(p, "loss") in row
            logged = [json.loads(ln) for ln in (run / "status.jsonl").read_text().splitlines()]
            assert p.get_attribute(f"{card} svg[data-chart=loss] polyline[data-series='train loss']", "data-n") == \
                str(sum("loss" in e for e in logged))
            # the validation videos, labelled by step and prompt, and playable through the server (with the token)
            prompts = yaml.safe_load((run / "config.yaml").read_text())["callbacks"]["validation"]["prompts"]
            videos = p.eval_on_selector_all(f"{card} figure.video", "els => els.map(e => [+e.dataset.step, "
                                            "e.dataset.prompt, e.querySelector('figcaption').textContent])")
            assert sorted(v[:2] for v in videos) == sorted([step, text] for step in (0, STEPS) for text in prompts)
            assert all(f"step {step}" in caption and text in caption for step, text, caption in videos)
            p.wait_for_function(f"() => [...document.querySelectorAll(\"{card} figure.video video\")].every("
                                "v => v.readyState >= 2 && v.videoWidth > 0)", timeout=wait)
            assert p.evaluate(f"() => document.querySelector(\"{card} .pictures img\").naturalWidth") > 0
    finally:
        proc.kill()
        proc.wait()
        log.close()
        server.shutdown()
        server.server_close()


def test_the_page_shows_each_gpus_power_and_clock(tmp_path):
    """The per-GPU table: each rank's power (of the card's limit) and SM clock as status.json holds them, '-' where
    NVML reported none."""
    import os
    import socket

    from tests.unit.test_status_cli import _run

    ranks = [{"rank": 0, "step": 40, "mem_gib": 12.5, "peak_mem_gib": 14.0, "gpu_util": 97.0, "gpu_power_w": 684.0,
              "gpu_power_limit_w": 700.0, "gpu_clock_mhz": 1752.0, "rejected_online": 0},
             {"rank": 1, "step": 40, "mem_gib": 12.5, "peak_mem_gib": 14.0, "gpu_util": 96.0, "rejected_online": 0}]
    _run(tmp_path / "outputs" / "live", state="running", step=40, total_steps=100, pid=os.getpid(),
         host=socket.gethostname(), world_size=2, mem_gib=12.5, gpu_util=97.0, ranks=ranks)
    server = make_server(tmp_path / "outputs", port=0, every_s=0.25)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    card = "section.run[data-run='live']"
    try:
        with browser.page() as p:
            p.goto(server.url)
            p.wait_for_selector(f"{card} tr[data-rank='1'] td[data-col=gpu_clock_mhz]", timeout=60_000)
            cells = p.eval_on_selector_all(f"{card} tr[data-rank]", "rows => rows.map(r => [r.dataset.rank, "
                                           "r.querySelector('[data-col=gpu_power_w]').textContent, "
                                           "r.querySelector('[data-col=gpu_clock_mhz]').textContent])")
            assert cells == [["0", "684 W of 700", "1752 MHz"], ["1", "-", "-"]]
    finally:
        server.shutdown()
        server.server_close()
