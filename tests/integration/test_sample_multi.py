"""wanexp-sample on several processes (CPU, gloo): sequence-parallel, CFG-parallel and combined sampling of a trained
tiny LoRA give the one-process sample's latents exactly, with the work split as claimed; the torchrun form with
--run-dir; a late or killed rank ends the launch with one line; bad grids are refused before anything loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wanexp.cli import sample

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# 64x64x5: 2 latent frames of 2x2 tokens = 8 DiT tokens; the tiny DiT has 2 heads
SHAPE = ["--height", "64", "--width", "64", "--frames", "5", "--steps", "3", "--seed", "1", "--device", "cpu"]


def _args(run, out: Path, *extra) -> list[str]:
    return ["--run-dir", run["output_dir"], "--prompt", "a red ball rolls", *SHAPE, "--save-latents",
            "--out", str(out), *extra]


def _command(args: list[str], env: dict | None = None, launcher=("-m", "wanexp.cli.sample")):
    return subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _latents(out: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(out / "p0_s1_latents.safetensors"))["latents"]


@pytest.fixture(scope="module")
def one(trained, tmp_path_factory):
    """The trained tiny run and its one-process sample (CFG 5, 3 steps)."""
    run = trained("tiny")
    out = tmp_path_factory.mktemp("one")
    res = sample.main(_args(run, out))
    return run, res


@pytest.mark.parametrize("extra, world, sp, cfg", [
    (["--gpus", "2", "--no-cfg-parallel"], 2, 2, 1),
    (["--gpus", "2"], 2, 1, 2),  # CFG parallel by default (the sample uses CFG)
    (["--gpus", "4"], 4, 2, 2),
    (["--gpus", "2", "--no-cfg-parallel", "--shard"], 2, 2, 1),
    (["--gpus", "4", "--shard"], 4, 2, 2),
])
def test_several_processes_give_the_one_process_sample(one, tmp_path, extra, world, sp, cfg):
    """The same latents to the bit on CPU (tolerance 0: every rank runs the same operations on its share and the
    shares are exchanged exactly); a CFG-parallel rank computes half of the transformer calls, a sequence-parallel
    one half of the tokens of each; with --shard each rank holds its 1/N of the weights (the LoRA's included)."""
    run, res = one
    done = _command(_args(run, tmp_path, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(_latents(tmp_path), res["samples"][0]["latents"])
    single = res["processes"]
    multi = json.loads((tmp_path / "metrics.json").read_text())["processes"]
    assert (multi["world"], multi["sp"], multi["cfg"]) == (world, sp, cfg)
    assert multi["block_tokens"] * sp == single["block_tokens"]
    assert multi["block_calls"] * cfg == single["block_calls"]
    (whole,) = single["weight_bytes"]
    if "--shard" in extra:  # the base weights split; each rank holds the LoRA (10 % of this tiny model) whole
        assert len(multi["weight_bytes"]) == world and max(multi["weight_bytes"]) < whole * (1 / world + 0.12)
    else:
        assert multi["weight_bytes"] == [whole] * world
    assert (tmp_path / "p0_s1.mp4").is_file() and done.stderr == ""


def test_a_sample_whose_tokens_do_not_divide_is_padded_to_the_ranks(trained, tmp_path):
    """96x96x1: one latent frame of 3x3 = 9 DiT tokens over --sp 2, padded to 10 (the attention leaves the padding
    out): the one-process latents to the bit."""
    run = trained("tiny")
    shape = ["--height", "96", "--width", "96", "--frames", "1"]
    res = sample.main([*_args(run, tmp_path / "one"), *shape])
    done = _command(_args(run, tmp_path / "sp2", "--gpus", "2", "--no-cfg-parallel", *shape))
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(_latents(tmp_path / "sp2"), res["samples"][0]["latents"])
    multi = json.loads((tmp_path / "sp2" / "metrics.json").read_text())["processes"]
    assert (multi["sp"], multi["block_tokens"]) == (2, 5)


def test_the_documented_torchrun_form_samples_a_run(one, tmp_path):
    """torchrun classifies every argument (--run is an ambiguous abbreviation of its --run-path): the run is passed
    as --run-dir, and its LoRA loads on every rank."""
    run, res = one
    done = _command(["--nproc_per_node=2", "-m", "wanexp.cli.sample", *_args(run, tmp_path)],
                    launcher=("-m", "torch.distributed.run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(_latents(tmp_path), res["samples"][0]["latents"])
    assert json.loads((tmp_path / "metrics.json").read_text())["loras"] == res["loras"] != []


@pytest.mark.parametrize("fault, expected", [
    ({"WANEXP_TEST_LATE_RANK": "1:startup:120"}, "rank 0: the 2 processes did not all start within 15 s (phase "
                                                  "'startup'"),
    ({"WANEXP_TEST_LATE_RANK": "1:loading:120"}, "rank 0: rank(s) 1 did not finish 'loading the weights' within "
                                                  "15 s"),
    ({"WANEXP_TEST_KILL_RANK": "1:sample"}, "rank 1 was killed by signal 9 during 'sample p0_s1'; the other ranks "
                                            "were stopped"),
])
def test_a_late_or_killed_rank_ends_the_launch_with_one_line(one, tmp_path, fault, expected):
    run, _ = one
    done = _command(_args(run, tmp_path, "--gpus", "2", "--timeout", "15"),
                    env={**fault, "PYTHONPATH": str(ROOT / "tests" / "faults")})
    assert done.returncode == 1
    assert done.stderr.startswith(f"wanexp: error: {expected}") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "p0_s1.mp4").exists()


@pytest.mark.parametrize("extra", [[], ["--gpus", "2", "--no-cfg-parallel", "--shard"]])
def test_offloaded_experts_give_the_sample_with_one_expert_on_the_device(trained, tmp_path, extra):
    """A two-expert model with --offload-experts (one process; two with sharded weights): the latents of the sample
    with both experts resident; the low-noise expert arrives once (the high-noise steps come first) and
    the weights held after loading are one expert's."""
    run = trained("tiny_t2v14b")
    base = ["--run-dir", run["output_dir"], "--prompt", "a red ball rolls", *SHAPE, "--save-latents", *extra]
    for args in ([*base, "--out", str(tmp_path / "both")],
                 [*base, "--offload-experts", "--out", str(tmp_path / "one")]):
        if extra:  # several processes: a launch of their own
            done = _command(args)
            assert done.returncode == 0, done.stderr[-3000:]
        else:  # one process: the command's entry here (as the module's one-process sample), no interpreter start
            sample.main(args)
    # on the CPU the weights loaded from the file's pages (not 64-byte aligned) are copied into memory of their own
    # to be movable, and the GEMMs round aligned data differently (5e-7 after one forward); on a GPU both are copies
    torch.testing.assert_close(_latents(tmp_path / "one"), _latents(tmp_path / "both"), rtol=1e-4, atol=1e-5)
    held = json.loads((tmp_path / "both" / "metrics.json").read_text())["processes"]
    got = json.loads((tmp_path / "one" / "metrics.json").read_text())["processes"]
    assert got["expert_moves"] == {"high": 0, "low": 1}
    for mine, whole in zip(got["weight_bytes"], held["weight_bytes"]):
        assert mine * 2 == pytest.approx(whole, rel=0.02)


@pytest.mark.parametrize("extra, expected", [
    (["--offload-experts"], "--offload-experts: model=tiny has one transformer, nothing to move aside"),
    (["--sp", "2"], "--sp 2 needs 2 processes, not 1; add --gpus N (or run it under torchrun "
                    "--nproc_per_node=N)"),
    (["--gpus", "3", "--cfg-parallel"], "--cfg-parallel with 3 process(es): CFG parallel needs an even number"),
    (["--gpus", "4", "--no-cfg-parallel"], "--sp 4: the model's 2 attention heads do not divide by 4; use --sp 2"),
])
def test_a_grid_that_cannot_split_is_refused_before_anything_starts(trained, tmp_path, capsys, extra, expected):
    run = trained("tiny")
    with pytest.raises(SystemExit) as e:
        sample.main([*_args(run, tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"wanexp: error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, grid", [
    (["--gpus", "2"], (2, 1)),  # CFG runs: its halves split, nothing exchanged inside a step
    (["--gpus", "2", "--guidance", "1"], (1, 2)),  # no CFG: the tokens split
    (["--gpus", "4"], (2, 2)),
    (["--gpus", "3", "--guidance", "1"], None),  # 3 does not divide the 2 heads: refused
    (["--gpus", "2", "--sp", "2"], (1, 2)),
])
def test_the_default_grid_splits_cfg_first(trained, tmp_path, extra, grid):
    run = trained("tiny")
    args = sample._parse([*_args(run, tmp_path), *extra])
    if grid is None:
        with pytest.raises(sample.ConfigError, match="--sp 3: the model's 2 attention heads"):
            sample._settings(args)
        return
    lay = sample._settings(args)["layout"]
    assert (lay.cfg, lay.sp) == grid
