"""A refused run writes nothing: every check that can refuse a run, those that need the built model, the model
folder's weight files or the machine's GPU included, runs before anything in the run folder is touched. Each refusal
through the CLI's ``cli`` in this process, on a copy of a finished run (resumed, and overwritten: ``experiment=demo``
sets overwrite=true) and on a fresh folder; a DeepSpeed resume's check (GPUs only) through the function the run
calls before it starts."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import compose_cfg
from tests.integration.test_lifecycle import _tiny_overrides
from wanexp.errors import ConfigError
from wanexp.parallel.zero import read_pointer, write_pointer
from wanexp.composition import build, read_resume_checkpoint
from wanexp.train import check_resume, cli

Usage = namedtuple("Usage", "total used free")


def _state(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file's bytes and every file's and folder's mtime (ns) under ``root``, the folder itself included."""
    paths = [root, *sorted(root.rglob("*"))]
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in paths}


def _lora_with_a_block_the_model_lacks(src: Path, dst: Path) -> Path:
    """The run's own LoRA file with every module of block 0 copied to block 7 (the tiny model has 2 blocks)."""
    sd = load_file(src / "lora" / "final" / "tiny_lora_comfyui.safetensors")
    sd.update({k.replace(".blocks.0.", ".blocks.7."): v.clone() for k, v in sd.items() if ".blocks.0." in k})
    save_file(sd, dst)
    return dst


def _truncated_model(src: Path, dst: Path) -> Path:
    """A copy of the tiny model folder whose transformer weights lost their second half (a partial download)."""
    shutil.copytree(src, dst)
    weights = dst / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return dst


def _no_fp8_gpu(m) -> None:
    """A GPU without the FP8 GEMM (a V100) in this CPU process (torch.cuda monkeypatched: no GPU here)."""
    m.setattr(torch.cuda, "is_available", lambda: True)
    m.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    m.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100S-PCIE-32GB")


def _full_disk(m) -> None:
    m.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))


def _refusals(src: Path, model: Path, tmp_path: Path) -> dict[str, tuple[list[str], str, object]]:
    """name -> (overrides, the one line's needle, what to patch or None): the refusals of a run the config alone does
    not show. ``src``: the finished run; ``model``: its model folder."""
    lora = _lora_with_a_block_the_model_lacks(src, tmp_path / "other_model.safetensors")
    corrupt = _truncated_model(model, tmp_path / "corrupt_model")
    return {
        "blocks_to_swap": (["model.blocks_to_swap=100"],
                           "model.blocks_to_swap=100: the dense transformer has 2 blocks; set model.blocks_to_swap "
                           "to at most 2", None),
        "init_from": ([f"adapter.init_from={lora}"],
                      "blocks.7.attn1.to_q is not in the model (2 blocks)", None),
        "keep_last": (["callbacks.lora_export.keep_last=0"], "callbacks.lora_export.keep_last=0: must be >= 1", None),
        # the start-up disk check with the disk reported full: a run continued for longer, or started over
        "disk": (["trainer.max_steps=400", "allow_resume_changes=true"], "needs ~", _full_disk),
        # a truncated weight file: its header describes more data than the file holds (no tensor is read)
        "corrupt_weights": ([f"model.path={corrupt}"],
                            f"model.path={corrupt}: cannot read the dense transformer "
                            "(transformer/diffusion_pytorch_model.safetensors: truncated", None),
        # model.fp8=true on a GPU below compute capability 8.9
        "fp8": (["model.fp8=true", "trainer.precision=bf16-mixed"],
                "model.fp8=true: Tesla V100S-PCIE-32GB (compute capability 7.0) has no FP8 GEMM", _no_fp8_gpu),
    }


def _model_folder(trained) -> Path:
    return Path(trained("tiny")["cfg"].model.path)


def _refused(cfg, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: "), err
    return err[0]


@pytest.mark.parametrize("mode", [["resume=last"], ["overwrite=true"]], ids=["resume", "overwrite"])
def test_every_refusal_leaves_a_finished_run_byte_and_mtime_identical(trained, tmp_path, capsys, monkeypatch, mode):
    """A finished run (status finished at step 4, checkpoints, LoRA exports incl. final, logs, its reject list)
    stays as it was, file by file and folder by folder, for each refusal, resumed or overwritten."""
    src = Path(trained("tiny")["output_dir"])
    out = tmp_path / "run"
    shutil.copytree(src, out, symlinks=True)
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    refusals = _refusals(src, _model_folder(trained), tmp_path)
    before = _state(out)
    for name, (overrides, needle, patch) in refusals.items():
        with monkeypatch.context() as m:
            if patch is not None:
                patch(m)
            line = _refused(compose_cfg([*_tiny_overrides(trained("tiny")["cfg"], out), *mode, *overrides]), capsys)
        after = _state(out)
        assert after == before, (name, sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k)))
        assert needle in line, (name, line)
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_every_refusal_of_a_fresh_run_leaves_no_folder(trained, tmp_path, capsys, monkeypatch):
    """The same refusals of a fresh run: no run folder (no config.yaml, status.json, logs/, .lock, rejects.jsonl)."""
    src = Path(trained("tiny")["output_dir"])
    out = tmp_path / "fresh" / "run"
    for name, (overrides, needle, patch) in _refusals(src, _model_folder(trained), tmp_path).items():
        with monkeypatch.context() as m:
            if patch is not None:
                patch(m)
            line = _refused(compose_cfg([*_tiny_overrides(trained("tiny")["cfg"], out), *overrides]), capsys)
        assert not (tmp_path / "fresh").exists(), (name, [str(p) for p in (tmp_path / "fresh").rglob("*")])
        assert needle in line, (name, line)


def test_a_missing_prompts_file_under_the_demo_is_named_and_nothing_is_generated_beside_it(shared_dir, tmp_path,
                                                                                          capsys):
    """experiment=demo generates its clips (data.generate): a data.metadata that names another file which does not
    exist is that file's one line, not the demo's metadata.csv, and no clips are generated into its folder."""
    prompts = tmp_path / "mine" / "prompts.txt"
    line = _refused(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                                 f"paths.output_dir={tmp_path / 'run'}", f"data.metadata={prompts}",
                                 "objective=dmd", "model.first_frame_cond=0"]), capsys)
    assert line.startswith(f"wanexp: error: data.metadata={prompts}: file not found (data.generate lists the clips "
                           "it generates in a metadata.csv"), line
    assert "set data.generate=null" in line and not (tmp_path / "mine").exists() and not (tmp_path / "run").exists()


def _deepspeed_checkpoint(lightning_ckpt: Path, folder: Path, model_states: str) -> Path:
    """The finished run's last checkpoint as parallel=deepspeed writes one (wanexp/parallel/zero.py): a .ckpt pointer
    naming its folder, whose tag folder (``latest``) holds the model states, i.e. the trainable weights and the client
    state (Lightning's checkpoint without its weights and optimizer states: the run's settings, the step)."""
    checkpoint = torch.load(lightning_ckpt, weights_only=True)
    ds = folder / "last.ckpt.1.ds"
    (ds / "checkpoint").mkdir(parents=True)
    (ds / "latest").write_text("checkpoint")
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    torch.save({"module": checkpoint["state_dict"], "optimizer": None, "ds_version": "0.19.8", "global_steps": 4,
                **client}, ds / "checkpoint" / model_states)
    write_pointer(folder / "last.ckpt", ds.name)
    return folder / "last.ckpt"


def _module(cfg):
    """The run's DiffusionModule as wanexp.train builds it (nothing loaded: the model is configured by the fit)."""
    from wanexp.module import DiffusionModule

    o = cfg.optim
    return DiffusionModule(build(cfg.model), build(cfg.adapter), build(cfg.objective), cfg.boundary,
                     optimizer=build(o.optimizer), lr=o.lr,
                     schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")},
                     max_steps=int(cfg.trainer.max_steps))


@pytest.mark.parametrize("states", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"],
                         ids=["zero2", "zero3"])
def test_a_deepspeed_resume_is_checked_before_the_run_starts(trained, tmp_path, states):
    """parallel=deepspeed (GPUs only; deepspeed need not be installed for this): the resume's settings are read from
    its folder's model states by the check that runs before the run folder is touched (wanexp.train.check_resume), as
    a Lightning checkpoint's are; a pointer whose folder or model states are gone is one line there too."""
    src = trained("tiny")
    ckpt = _deepspeed_checkpoint(Path(src["output_dir"]) / "checkpoints" / "last.ckpt", tmp_path / "checkpoints",
                                 states)
    saved = read_resume_checkpoint(str(ckpt), "deepspeed")
    assert saved["global_step"] == 4 and saved["wanexp"]["fixed"]["adapter.rank"] == 4
    check_resume(_module(src["cfg"]), str(ckpt), "deepspeed")  # the run's own settings: resumed
    with pytest.raises(ConfigError, match=r"^resume: adapter.rank=4 in the checkpoint, 8 now: the checkpoint's "):
        check_resume(_module(compose_cfg([*_tiny_overrides(src["cfg"], tmp_path), "adapter.rank=8"])), str(ckpt),
                     "deepspeed")
    folder = ckpt.parent / read_pointer(ckpt)
    (folder / "checkpoint" / states).unlink()
    with pytest.raises(ConfigError, match=rf"^resume={ckpt}: its DeepSpeed folder {folder} holds no model states"):
        read_resume_checkpoint(str(ckpt), "deepspeed")
    shutil.rmtree(folder)
    with pytest.raises(ConfigError, match=rf"^resume={ckpt}: its DeepSpeed folder {folder} is missing"):
        read_resume_checkpoint(str(ckpt), "deepspeed")
