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
