"""The ``hw`` group: a card's preset sets precision, weight and VAE dtypes, compilation and the memory budget the
planner sizes block swap and checkpointing to; an option of an optional group that has no file is one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose_cfg
from tests.unit.test_blockswap import a14b_spec
from wanexp import memory_plan
from wanexp.config import CONF_DIR, check_config, check_optional_groups
from wanexp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CARDS = sorted(f.stem for f in (CONF_DIR / "hw").glob("*.yaml"))


def test_the_cards_are_the_documented_ones():
    assert CARDS == ["a100_40g", "a100_80g", "h100_80g", "rtx4090_24g", "v100_32g"]


@pytest.mark.parametrize("card", CARDS)
def test_each_preset_composes_and_passes_the_config_rules(card):
    cfg = compose_cfg([f"hw={card}", "model.path=/m"])
    check_config(cfg)
    assert cfg.model.blocks_to_swap == "auto" and cfg.model.memory_budget_gib < int(card.split("_")[1][:-1])


def test_the_v100_preset_is_the_fp16_path():
    """No bf16 and no Triton on sm_70: fp16 weights under 16-mixed, the fp16 VAE, eager blocks, 28 of its 32 GB."""
    cfg = compose_cfg(["hw=v100_32g", "model.path=/m"])
    assert (cfg.trainer.precision, cfg.model.dtype, cfg.model.vae_dtype, cfg.model.compile) == \
        ("16-mixed", "fp16", "fp16", False)
    assert cfg.model.memory_budget_gib == 28


def test_a_smaller_card_streams_more_blocks_and_an_80g_card_none():
    """The A14B expert at 480x832x81 with offloaded block inputs: blocks_to_swap=auto sized by each card's budget."""
    def swapped(card):
        cfg = compose_cfg(["model=i2v14b", "boundary=high", f"hw={card}", "data.num_frames=81", "data.batch_size=1",
                           "data.buckets=null", "data.token_budget=null", "data.height=480", "data.width=832",
                           "model.offload_activations=true", "model.path=/m"])
        return memory_plan.resolve_blocks_to_swap(cfg, a14b_spec(), verbose=False)

    n = {card: swapped(card) for card in ("rtx4090_24g", "v100_32g", "a100_40g", "h100_80g")}
    assert n["rtx4090_24g"] > n["v100_32g"] > 0 and n["a100_40g"] < n["v100_32g"] and n["h100_80g"] == 0, n


def test_an_option_without_its_file_is_one_line_before_anything_composes(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "hw=v200"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == (
        "wanexp: error: hw=v200: no such hw option (conf/hw/v200.yaml); the options: a100_40g, a100_80g, h100_80g, "
        "rtx4090_24g, v100_32g\n")
    with pytest.raises(ConfigError, match=r"^experiment=nonexist: no such experiment option .* the options: demo, demo_squares$"):
        compose_cfg(["experiment=nonexist"])
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n")
    check_optional_groups(["experiment=mine", f"hydra.searchpath=[file://{tmp_path}]"])  # the user's own folder
    check_optional_groups(["hw=v100_32g,h100_80g", "sweep=null"])  # a sweep over cards
