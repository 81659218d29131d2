"""ComfyUI itself loads wanexp's ComfyUI files: its key mapping for Wan, ``load_lora`` and each weight adapter's
``calculate_weight`` (tests/comfyui_check.py) give, for LoRA, DoRA, LoKr and LoHa, the weights peft's merge of the
trained adapter gives. Needs a ComfyUI source tree: ``WANEXP_COMFYUI_DIR=/path/to/ComfyUI`` (the folder holding
``comfy/``); skipped without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

COMFYUI = os.environ.get("WANEXP_COMFYUI_DIR")
TOL = 1e-5


@pytest.mark.skipif(not COMFYUI, reason="set WANEXP_COMFYUI_DIR to a ComfyUI source tree (the folder holding comfy/) "
                                        "to run ComfyUI's own LoRA loader on wanexp's exports")
def test_comfyuis_own_loader_reproduces_each_kind():
    r = subprocess.run([sys.executable, "-m", "tests.comfyui_check", COMFYUI], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    kinds = json.loads(r.stdout.splitlines()[-1])["kinds"]
    assert set(kinds) == {"lora", "dora", "lokr", "lokr_lowrank", "loha"}
    for kind, k in kinds.items():
        assert k["unloaded_keys"] == [] and k["unknown_names"] == [], (kind, k)
        assert k["patched"] == k["adapted"] == 20, (kind, k)  # every adapted linear of the 2-block model
        assert k["max_abs_diff"] <= TOL and k["max_abs_diff_strength_0_5"] <= TOL, (kind, k)
    assert {kind: k["adapter"] for kind, k in kinds.items()} == {
        "lora": ["LoRAAdapter"], "dora": ["LoRAAdapter"], "lokr": ["LoKrAdapter"], "lokr_lowrank": ["LoKrAdapter"],
        "loha": ["LoHaAdapter"]}
