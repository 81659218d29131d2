"""Between log steps a training step reads nothing back from the device and turns no host number into a tensor.

On a GPU each of those is a host sync (``.item()``, ``float()``, ``bool()``, ``.tolist()``; ``self.log(0.5)`` builds a
device tensor with a blocking copy): the host waits for the GPU, so the work between two steps (Lightning's loop, the
loader, callbacks) stops overlapping the GPU's. The CPU has no syncs to see, so the test watches the calls that would
be one: a torch function mode records every such call made during ``python train.py``'s loop (the loader's own host
tensors aside), with the optimizer step it happened in. Logging at steps 4 and 8 (``log_every_n_steps=4``) may read;
steps 2, 3, 6 and 7 must not. The run is the default path: from the cache, the progress bar and every default
callback on, fused AdamW (the GPU default; it skips a non-finite step on the device).
"""
from __future__ import annotations

import collections
import traceback

import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode

from tests.integration.conftest import tiny_run
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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        number = func is torch.tensor and args and not isinstance(args[0], torch.Tensor)
        if func in READS or number:
            stack = traceback.extract_stack()[:-1]
            if not any("torch/utils/data/" in f.filename for f in stack):  # the loader's host tensors
                where = next(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno}" for f in reversed(stack)
                             if "torch/overrides" not in f.filename)
                # the optimizer step this belongs to: the one in progress until its training step is processed
                # (the step-end hooks and the logging after them run with global_step already counting it)
                done = self.progress.processed == self.progress.ready
                self.calls[self.trainer.global_step + (0 if done else 1)][(func.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


class WatchReads(Callback):
    """Records the calls above, per optimizer step, from the start of training to its end."""

    def __init__(self):
        self.mode: _Record | None = None

    def on_train_start(self, trainer, pl_module):
        self.mode = _Record(trainer)
        self.mode.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.mode.__exit__(None, None, None)


def test_no_host_reads_between_log_steps(shared_dir, tmp_path):
    cache = tmp_path / "cache"
    build_cache(_cfg(shared_dir, cache))
    r = tiny_run(shared_dir, tmp_path / "run", [
        "model=tiny", f"data.cache_dir={cache}", "trainer.max_steps=8", "trainer.log_every_n_steps=4",
        "+callbacks.progress._target_=wanexp.callbacks.progress.StepProgressBar", "optim.optimizer.fused=true", "callbacks.checkpoint.every_n_train_steps=100",
        "+callbacks.zz_watch._target_=tests.integration.test_host_syncs.WatchReads"])
    assert r["global_step"] == 8 and r["module"].encoders is None
    watch = next(cb for cb in r["trainer"].callbacks if isinstance(cb, WatchReads))
    calls = watch.mode.calls
    assert calls[4] and calls[8], "the probe saw no read at the log steps: it is not watching"
    between = {step: dict(calls[step]) for step in (2, 3, 6, 7) if calls[step]}
    assert not between, f"host reads or host numbers made into tensors between log steps: {between}"
