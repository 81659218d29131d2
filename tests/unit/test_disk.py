"""The disk a run keeps (estimate, start check), LoRA export retention and a full disk during a save."""
from __future__ import annotations

import errno
import io
import math
import shutil
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from tests import wan_adapters as lora
from wanexp import disk
from wanexp.callbacks.checkpoint import AtomicCheckpointIO, CheckpointWriteError
from wanexp.callbacks.lora_export import FLAG_FILE, LoraExport
from wanexp.errors import ConfigError
from tests.wan_adapters import LoraAdapter
from wanexp.objectives.base import Objective
from wanexp.runfolder import remove_stale_temporaries

TI2V_5B = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336,
           "num_layers": 30, "text_dim": 4096, "freq_dim": 256, "in_channels": 48, "out_channels": 48}
Usage = namedtuple("Usage", "total used free")


def five_b(callbacks: dict, max_steps: int = 425_000, adapters=("default",)) -> disk.DiskNeed:
    from diffusers import WanTransformer3DModel

    spec = SimpleNamespace(trained_experts=lambda boundary: ["dense"], transformer_config=lambda e: dict(TI2V_5B),
                           transformer_type=lambda: WanTransformer3DModel)
    lora = LoraAdapter(name="lora", rank=32, alpha=32, dropout=0.0, targets=["q", "k", "v", "o", "ffn.0", "ffn.2"],
                       attention=["self", "cross"], init_from=None)
    objective = Objective("flow_matching")
    objective.adapters = adapters

    trained = disk.trained_parameters(spec, lora, objective, "full", spec.meta_transformers("full"))
    return disk.estimate(trained, callbacks, max_steps)


def test_the_5b_r32_estimate_counts_the_adapter_on_the_meta_device():
    """The user's run: 80.6M LoRA parameters (fp32) -> ~645 MB per export (two files), ~967 MB per checkpoint with
    AdamW's moments; 425K steps, a checkpoint + export every 250, 3 + last kept, 3 exports + final."""
    callbacks = {"checkpoint": {"every_n_train_steps": 250, "save_top_k": 3},
                 "lora_export": {"keep_last": 3, "keep_every": None}}
    need = five_b(callbacks)
    params = 80_609_280  # peft's own count of this adapter (30 blocks x (8 attention + 2 FFN linears), rank 32)
    assert need.checkpoint_bytes == params * 12 and params * 8 < need.export_bytes < params * 8 * 1.001  # + headers
    assert (need.checkpoints, need.exports) == (4, 4)
    assert 6.0 < need.total / 2**30 < 6.2
    # milestones every 50K steps: 50K..400K (8) besides the newest 3 and final; keep_last=-1: every export (1700)
    callbacks["lora_export"] = {"keep_last": 3, "keep_every": 50_000}
    assert five_b(callbacks).exports == 3 + 8 + 1
    callbacks["lora_export"] = {"keep_last": -1, "keep_every": None}
    assert five_b(callbacks).exports == 425_000 // 250 + 1
    # two adapters (DMD's generator + critic): both in the checkpoint, one exported; no export callback: none
    two = five_b({"checkpoint": callbacks["checkpoint"], "lora_export": None}, adapters=("gen", "critic"))
    assert two.checkpoint_bytes == 2 * params * 12 and two.exports == 0


# A one-block Wan DiT whose linears are large enough that tensor data, not headers, make up a file (dim 256, FFN 768)
SMALL = dict(num_attention_heads=4, attention_head_dim=64, ffn_dim=768, num_layers=1, text_dim=16, freq_dim=16,
             in_channels=4, out_channels=4, patch_size=[1, 2, 2])


@pytest.mark.parametrize("kind, dora, rank", [("lora", False, 4), ("lora", True, 4), ("lokr", False, 4),
                                              ("lokr", False, 1), ("loha", False, 4)])
def test_each_adapter_kind_is_sized_as_peft_makes_it_and_its_export_writes_it(kind, dora, rank, tmp_path):
    """The estimate's count per kind equals peft's parameters and tensors on the model; one export's bytes (ComfyUI
    file, plus diffusers' but for LoHa) are within 10 % of the files an export writes."""
    from diffusers import WanTransformer3DModel

    from tests.wan_adapters import LohaAdapter, LokrAdapter, is_adapter_key

    cls = {"lora": LoraAdapter, "lokr": LokrAdapter, "loha": LohaAdapter}[kind]
    adapter = cls(name=kind, rank=rank, alpha=2.0, dropout=0.0, targets=["q", "k", "v", "o", "ffn.0", "ffn.2"],
                  attention=["self", "cross"], init_from=None, use_dora=dora)
    t = WanTransformer3DModel(**SMALL).requires_grad_(False)
    size = lora.adapter_size(t, adapter)
    adapter.apply(t)
    made = [p for n, p in t.named_parameters() if is_adapter_key(n)]
    assert (size.parameters, size.tensors, size.modules) == (sum(p.numel() for p in made), len(made), 10)
    files = adapter.export(t.state_dict(), "", t, tmp_path, "small")
    written = sum(f.stat().st_size for f in files)
    assert abs(disk.export_bytes(size, kind) / written - 1) < 0.1, (disk.export_bytes(size, kind), written)


def test_the_kinds_differ_as_their_factors_do():
    """On the 5B's 3072-wide projections at rank 32: LoHa holds twice LoRA's parameters, DoRA LoRA's plus one
    magnitude per output row, LoKr far fewer (factors near the square roots of the sides)."""
    def params(kind, dora=False):
        return sum(math.prod(s) for s in lora.adapter_tensor_shapes(kind, 32, dora, 3072, 3072))

    assert params("loha") == 2 * params("lora") == 2 * 32 * 6144
    assert params("lora", dora=True) == params("lora") + 3072
    assert params("lokr") == 48 * 48 + 64 * 64  # 3072 = 48 x 64; rank 32 reaches 64 / 2: both factors full
    assert lora.adapter_tensor_shapes("lokr", 31, False, 3072, 3072) == [(48, 48), (64, 31), (31, 64)]
    assert lora.adapter_tensor_shapes("lokr", 32, False, 3072, 3072) == [(48, 48), (64, 64)]


def test_retention_counts():
    assert disk.save_steps(10, 4) == [4, 8, 10] and disk.save_steps(8, 4) == [4, 8] and disk.save_steps(-1, 4) is None
    assert disk.held_checkpoints([4, 8, 10], 3) == 3 and disk.held_checkpoints(None, 3) == 4
    assert disk.held_checkpoints(None, -1) is None and disk.held_checkpoints([4, 8], None) == 1
    assert disk.held_exports([2, 4, 6, 8], 1, 4) == 3  # 8 (newest, a milestone), 4 (milestone), final
    assert disk.held_exports(None, 2, None) == 3 and disk.held_exports(None, 2, 5) is None


def test_the_start_check_refuses_a_folder_that_cannot_hold_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    need = disk.DiskNeed(checkpoint_bytes=3 * 2**30, checkpoints=4, export_bytes=2**30, exports=4)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(2**40, 2**40 - 10 * 2**30, 10 * 2**30))
    with pytest.raises(ConfigError) as e:
        disk.check_disk(out, need)
    assert str(e.value) == (
        f"paths.output_dir={out}: needs ~16.0 GiB (checkpoints 4 x 3.0 GiB, LoRA exports 4 x 1.0 GiB), 10.0 GiB free; "
        "free space or set callbacks.lora_export.keep_last / callbacks.checkpoint.save_top_k lower")
    assert not out.exists()  # nothing written
    # a resumed run: what it already wrote counts as part of what it keeps
    (out / "checkpoints").mkdir(parents=True)
    with open(out / "checkpoints" / "step_000250.ckpt", "wb") as f:
        f.truncate(7 * 2**30)  # sparse: takes no space here
    disk.check_disk(out, need)
    line = capsys.readouterr().out
    assert "wanexp: disk: ~16.0 GiB at the retention set (checkpoints 4 x 3.0 GiB, LoRA exports 4 x 1.0 GiB; " \
           "7.0 GiB of it already written), 10.0 GiB free on" in line


def _export(root, step, files=("tiny_lora_comfyui.safetensors", "tiny_lora_diffusers.safetensors")):
    folder = root / "lora" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"x" * 10)
    return folder


def _names(root):
    return sorted(p.name for p in (root / "lora").iterdir())


def test_exports_are_pruned_to_the_newest_plus_milestones_and_flagged(tmp_path):
    for step in (100, 200, 300, 400, 500, 600):
        _export(tmp_path, step)
    (tmp_path / "lora" / "step_000200" / FLAG_FILE).write_text("[]")  # status.json lists its files: kept
    (tmp_path / "lora" / "final").mkdir()
    (tmp_path / "lora" / "notes").mkdir()  # not an export of this run: never touched
    export = LoraExport(str(tmp_path), flag_above=100.0, keep_last=2, keep_every=300)
    pruned = export.prune(newest=600)
    assert [p.name for p in pruned] == ["step_000100", "step_000400"]  # oldest first
    assert _names(tmp_path) == ["final", "notes", "step_000200", "step_000300", "step_000500", "step_000600"]
    assert LoraExport(str(tmp_path), 100.0, keep_last=-1).prune(newest=600) == []
    # the export just written is kept even when a newer step's export is on disk (a resume from an older checkpoint)
    _export(tmp_path, 50)
    LoraExport(str(tmp_path), 100.0, keep_last=1).prune(newest=50)
    assert _names(tmp_path) == ["final", "notes", "step_000050", "step_000200", "step_000600"]


def test_a_kill_during_pruning_leaves_only_whole_exports(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        _export(tmp_path, step)
    real = shutil.rmtree

    def killed(path, *a, **k):  # the process dies half way through deleting the first pruned export
        if str(path).endswith(".prune.tmp") and path.exists():
            (path / "tiny_lora_comfyui.safetensors").unlink()
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        LoraExport(str(tmp_path), 100.0, keep_last=1).prune(newest=3)
    monkeypatch.undo()
    steps = sorted(p for p in (tmp_path / "lora").iterdir() if p.name.startswith("step_"))
    assert [p.name for p in steps] == ["step_000002", "step_000003"]
    assert all(len(list(p.iterdir())) == 2 for p in steps)  # every visible export is whole
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".step_000001.prune.tmp"]
    assert _names(tmp_path) == ["step_000002", "step_000003"]


def test_keep_last_zero_is_one_line():
    with pytest.raises(ConfigError, match=r"callbacks.lora_export.keep_last=0: must be >= 1 .* or -1"):
        LoraExport("out", 100.0, keep_last=0)


class FullDisk(io.RawIOBase):
    """A file on a disk that fills after ``room`` bytes: writes then fail with ENOSPC, as the OS reports it."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            self.f.write(bytes(b[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    io_ = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io_.save_checkpoint({"step": 1}, path)
    real = torch.save
    # the real zip writer on a disk that fills: RuntimeError("... unexpected pos ..."), its __context__ the ENOSPC
    monkeypatch.setattr(torch, "save", lambda obj, f: real(obj, FullDisk(f, 2000)))
    with pytest.raises(CheckpointWriteError) as e:
        io_.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    assert isinstance(e.value.__context__, RuntimeError) and "unexpected pos" in str(e.value.__context__)
    msg = str(e.value)
    assert msg.startswith(f"disk full while saving checkpoint {path}: free space on /") and "\n" not in msg
    assert "or lower retention (callbacks.lora_export.keep_last / callbacks.checkpoint.save_top_k); the previous " \
           "checkpoint is intact; then continue with resume=last" in msg
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # the partial temporary file is gone
    # a RuntimeError that is not the disk is a bug: it keeps its traceback
    monkeypatch.setattr(torch, "save", lambda obj, f: (_ for _ in ()).throw(RuntimeError("cannot pickle 'x'")))
    with pytest.raises(RuntimeError, match="cannot pickle"):
        io_.save_checkpoint({"step": 3}, path)


def test_disk_full_is_recognised_in_every_writer_s_form():
    from safetensors import SafetensorError

    assert disk.is_disk_full(SafetensorError("Error while serializing: I/O error: No space left on device "
                                             "(os error 28)"))
    assert disk.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not disk.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk.is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
