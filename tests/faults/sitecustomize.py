"""Fault injection for the runs that tests/integration/test_lifecycle.py starts (this folder is on their PYTHONPATH
only): ``WANEXP_TEST_SLOW_FSYNC=<seconds>`` makes each ``os.fsync`` wait first, so that a test can SIGKILL a run
while a checkpoint is being written (checkpoints are fsynced before their rename)."""
import os
import time

_DELAY = float(os.environ.get("WANEXP_TEST_SLOW_FSYNC") or 0)
if _DELAY:
    _fsync = os.fsync

    def _slow_fsync(fd):
        time.sleep(_DELAY)
        _fsync(fd)

    os.fsync = _slow_fsync

# ``WANEXP_TEST_FSDP_NO_RECOMPUTE_CAST=1``: FSDP2 as in torch <= 2.11, whose pre-forward hook returned early while a
# checkpointed block was recomputed in the backward, skipping the mixed-precision cast of the block's inputs (torch
# 2.13 casts them there too). tests/integration/test_fsdp_cpu.py runs FSDP + activation checkpointing under it.
if os.environ.get("WANEXP_TEST_FSDP_NO_RECOMPUTE_CAST"):
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    _pre_forward = _fsdp_state.FSDPState._pre_forward

    def _pre_forward_without_recompute_cast(self, module, args, kwargs):
        if self._training_state == _fsdp_state.TrainingState.PRE_BACKWARD:
            for group in self._fsdp_param_groups:  # unshard as torch does, but leave the inputs as they come
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return args, kwargs
        return _pre_forward(self, module, args, kwargs)

    _fsdp_state.FSDPState._pre_forward = _pre_forward_without_recompute_cast

# ``WANEXP_TEST_FREE_HOST_BYTES=<n>``: psutil reports this much free host memory (the load turns' auto mode).
# ``WANEXP_TEST_LOAD_LOG=<file>``: each rank appends "rank start end" for its load-and-shard turn (time.monotonic).
if os.environ.get("WANEXP_TEST_FREE_HOST_BYTES"):
    import psutil

    _vm = psutil.virtual_memory

    def _virtual_memory():
        return _vm()._replace(available=int(os.environ["WANEXP_TEST_FREE_HOST_BYTES"]))

    psutil.virtual_memory = _virtual_memory
if os.environ.get("WANEXP_TEST_LOAD_LOG"):
    import wanexp.module as _module

    _build = _module.DiffusionModule._build_and_place

    def _logged_build(self, *args, **kwargs):
        t0 = time.monotonic()
        _build(self, *args, **kwargs)
        time.sleep(0.5)  # a turn long enough that a concurrent one would overlap it
        with open(os.environ["WANEXP_TEST_LOAD_LOG"], "a") as f:
            f.write(f"{self.global_rank} {t0} {time.monotonic()}\n")

    _module.DiffusionModule._build_and_place = _logged_build

# ``WANEXP_TEST_LATE_RANK=<rank>:<phase>:<seconds>``: that rank of a generation on several processes sleeps as it
# enters the phase (wanexp.parallel.generation.set_phase) whose name starts with <phase>;
# ``WANEXP_TEST_KILL_RANK=<rank>:<phase>``: it SIGKILLs itself there instead.
if os.environ.get("WANEXP_TEST_LATE_RANK") or os.environ.get("WANEXP_TEST_KILL_RANK"):
    import signal

    import wanexp.parallel.generation as _generation

    _set_phase = _generation.set_phase

    def _faulty_set_phase(name):
        _set_phase(name)
        for var in ("WANEXP_TEST_LATE_RANK", "WANEXP_TEST_KILL_RANK"):
            rank, phase, *seconds = (os.environ.get(var) or "::").split(":")
            if rank == os.environ.get("RANK") and phase and name.startswith(phase):
                if seconds:
                    time.sleep(float(seconds[0]))
                else:
                    os.kill(os.getpid(), signal.SIGKILL)

    _generation.set_phase = _faulty_set_phase
