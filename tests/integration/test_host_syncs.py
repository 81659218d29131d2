"""Between log steps a training step reads nothing back from the device and turns no host number into a tensor.

On a GPU each of those is a host sync (``.item()``, ``float()``, ``bool()``, ``.tolist()``; ``self.log(0.5)`` builds a
device tensor with a blocking copy; a barrier): the host waits for the GPU, so the work between two steps (Lightning's
loop, the loader, callbacks) stops overlapping the GPU's. The CPU has no syncs to see, so the test watches the calls
that would be one: a torch function mode (and a wrapped ``torch.distributed.barrier``) records every such call made
during ``python train.py``'s loop (the loader's own host tensors aside), with the optimizer step it happened in.
Logging at steps 4 and 8 (``log_every_n_steps=4``) may read, once the step's forward, backward and optimizer step are
issued (a read in the middle of a step leaves the GPU idle while the host issues the rest); steps 2, 3, 6 and 7 must
not read at all. The run is the default path
with 2 ranks (DDP over gloo): from the cache, the progress bar and every default callback on, fused AdamW (the GPU
default; it skips a non-finite step on the device).
"""
from __future__ import annotations

import collections
import json
import traceback
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode

from tests.conftest import run_cli
from tests.integration.test_cache import _cfg
from wanexp.cli.cache import build_cache

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__index__}


class _Record(TorchFunctionMode):
    def __init__(self, trainer):
        super().__init__()
        self.progress = trainer.fit_loop.epoch_loop.batch_progress.current
        self.trainer = trainer
        self.calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.early: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.issued = False  # this step's optimizer step has returned (its work is all issued)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        number = func is torch.tensor and args and not isinstance(args[0], torch.Tensor)
        if func in READS or number:
            self.record(func.__name__)
        return func(*args, **(kwargs or {}))

    def record(self, name: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any("torch/utils/data/" in f.filename for f in stack):  # the loader's host tensors
            return
        where = next(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno}" for f in reversed(stack)
                     if "torch/overrides" not in f.filename and f.filename != __file__)
        # the optimizer step this belongs to: the one in progress until its training step is processed (the
        # step-end hooks and the logging after them run with global_step already counting it)
        done = self.progress.processed == self.progress.ready
        step = self.trainer.global_step + (0 if done else 1)
        self.calls[step][(name, where)] += 1
        if not self.issued:
            self.early[step][(name, where)] += 1


class WatchReads(Callback):
    """Records the calls above, per optimizer step, from the start of training to its end; writes them to
    ``{path}.rank{r}`` as JSON ``{step: {"func site": count}}``."""

    def __init__(self, path: str):
        self.path = path
        self.mode: _Record | None = None

    def on_train_start(self, trainer, pl_module):
        self.mode = _Record(trainer)
        self.mode.__enter__()
        # a barrier blocks the host too (Lightning's strategy.reduce puts one before its all-reduce)
        self._barrier = torch.distributed.barrier

        def barrier(*args, **kwargs):
            self.mode.record("barrier")
            return self._barrier(*args, **kwargs)

        torch.distributed.barrier = barrier
        for opt in trainer.optimizers:  # the torch optimizer: its step runs the closure (forward, backward) first
            step = opt.step

            def issued(*args, _step=step, **kwargs):
                out = _step(*args, **kwargs)
                self.mode.issued = True
                return out

            opt.step = issued

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode.issued = False

    def on_train_end(self, trainer, pl_module):
        torch.distributed.barrier = self._barrier
        self.mode.__exit__(None, None, None)
        calls = {kind: {step: {" ".join(k): n for k, n in c.items()} for step, c in found.items()}
                 for kind, found in (("calls", self.mode.calls), ("early", self.mode.early))}
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(json.dumps(calls))


# LaggedMax (the preemption flag under several ranks) reads the flag that the previous step's all-reduce copied into
# pinned host memory, after waiting for that step's event: not a read of the device, but the probe cannot tell.
PINNED_HOST_READS = {"__int__ callbacks/preemption.py"}


@pytest.mark.slow
def test_no_host_reads_between_log_steps(shared_dir, tmp_path):
    cache, rec = tmp_path / "cache", tmp_path / "reads"
    build_cache(_cfg(shared_dir, cache))
    res = run_cli(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
                   f"paths.output_dir={tmp_path}/run", f"data.cache_dir={cache}", "parallel=ddp",
                   "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=8", "trainer.log_every_n_steps=4",
                   "optim.optimizer.fused=true", "callbacks.checkpoint.every_n_train_steps=100",
                   "+callbacks.zz_watch._target_=tests.integration.test_host_syncs.WatchReads",
                   f"+callbacks.zz_watch.path={rec}"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads(Path(f"{rec}.rank{rank}").read_text())
        calls, early = ({int(k): v for k, v in found[kind].items()} for kind in ("calls", "early"))
        assert calls.get(4) and calls.get(8), f"rank {rank}: no read seen at the log steps: the probe is not watching"
        between = {step: {site: n for site, n in calls[step].items() if site.rsplit(":", 1)[0] not in PINNED_HOST_READS}
                   for step in (2, 3, 6, 7) if step in calls}
        between = {step: sites for step, sites in between.items() if sites}
        assert not between, f"rank {rank}: host reads or host numbers made into tensors between log steps: {between}"
        # step 8: at the first log step Lightning makes its state for each key first logged there (once per run)
        mid = {site: n for site, n in early.get(8, {}).items() if site.rsplit(":", 1)[0] not in PINNED_HOST_READS}
        assert not mid, f"rank {rank}: reads at a log step before its optimizer step was issued: {mid}"
