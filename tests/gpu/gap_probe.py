"""One process, one model load: the training loop's step time against loops without Lightning, on the same module,
the same compiled blocks and the same data (issue 8, item 7: where `python train.py` loses time to the bench).

    python tests/gpu/gap_probe.py OVERRIDES...      (train.py's overrides; the run's folder is paths.output_dir)

Prints one ``probe:`` line per variant, each the mean of steps 21-40 (back to back, GPU synchronized at both ends):
  fit_default      python train.py's path (wanexp.train.run), every default callback, the configured loader
  manual_fixed_synced  a plain loop: one batch kept on the GPU, the module's objective under autocast,
                   backward, clip_grad_norm_, the optimizer wanexp builds, the GPU synchronized after each step
                   (the bench's timing)
  manual_fixed     the same without a sync between steps (as a training loop runs; again at the end: the drift)
  manual_loader    the same loop fed by the run's DataLoader (workers, pinned memory, non-blocking copies)
  fit_bare         Lightning's loop with no callback, logger or checkpointing (only the timer)
  fit_no_workers   every default callback, the loader without worker processes
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import open_dict

START, STEPS = 20, 20


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def manual(module, batches, device, sync_each_step: bool = False) -> float:
    """Mean seconds per step of steps START+1 .. START+STEPS of a loop without Lightning (``sync_each_step``: the
    bench's timing, the GPU synchronized after every step)."""
    from wanexp.models.encoders import cached_batch

    module.to(device)  # Lightning's teardown moves the module to the CPU at the end of a fit
    opt = module.configure_optimizers()["optimizer"]
    params = [p for group in opt.param_groups for p in group["params"]]
    t0 = None
    for i, batch in enumerate(batches):
        if i == START:
            _sync(device)
            t0 = time.perf_counter()
        if i == START + STEPS:
            _sync(device)
            return (time.perf_counter() - t0) / STEPS
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = module.objective(cached_batch(batch), module.denoiser).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sync_each_step:
            _sync(device)
    raise SystemExit(f"gap_probe: the loader gave fewer than {START + STEPS} batches; generate more clips")


def loader_batches(dm):
    while True:  # epochs back to back
        yield from dm.train_dataloader()


def fit_again(cfg, module, dm, name: str) -> float:
    """A second Lightning fit of the same (already loaded and compiled) module, every default callback."""
    from wanexp.train import build_trainer

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.paths.output_dir = f"{cfg.paths.output_dir}_{name}"
    trainer = build_trainer(cfg, Path(cfg.paths.output_dir))
    trainer.strategy.sp_size = 1
    timer = next(c for c in trainer.callbacks if type(c).__name__ == "StepTimer")
    trainer.fit(module, datamodule=dm)
    return timer.mean_s


def main(argv: list[str]) -> None:
    from wanexp.config import compose
    from wanexp.train import run

    timer = {"_target_": "tests.helpers.StepTimer", "start": START, "steps": STEPS}
    cfg = compose([*argv, f"trainer.max_steps={START + STEPS + 1}", "callbacks.progress=null",
                   "callbacks.validation.every_n_steps=0", "callbacks.checkpoint.every_n_train_steps=1000"])
    with open_dict(cfg):
        cfg.callbacks.timer = timer
    result = run(cfg)
    module, trainer = result["module"], result["trainer"]
    dm = trainer.datamodule
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = next(c for c in trainer.callbacks if type(c).__name__ == "StepTimer").mean_s
    print(f"probe: fit_default {1000 * t:.1f} ms", flush=True)

    first = next(iter(dm.train_dataloader()))
    fixed = {k: v.to(device) if torch.is_tensor(v) else v for k, v in first.items()}
    same = iter(lambda: fixed, None)
    print(f"probe: manual_fixed_synced {1000 * manual(module, same, device, sync_each_step=True):.1f} ms", flush=True)
    print(f"probe: manual_fixed {1000 * manual(module, same, device):.1f} ms", flush=True)
    print(f"probe: manual_loader {1000 * manual(module, loader_batches(dm), device):.1f} ms", flush=True)

    import lightning as L

    from tests.helpers import StepTimer

    bare = StepTimer(START, STEPS)
    tc = cfg.trainer
    L.Trainer(accelerator=tc.accelerator, devices=1, precision=tc.precision, max_steps=START + STEPS + 1,
              gradient_clip_val=tc.gradient_clip_val, callbacks=[bare], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
              default_root_dir=f"{cfg.paths.output_dir}_bare").fit(module, datamodule=dm)
    print(f"probe: fit_bare {1000 * bare.mean_s:.1f} ms", flush=True)
    dm.num_workers = 0
    t = fit_again(cfg, module, dm, "no_workers")
    print(f"probe: fit_no_workers {1000 * t:.1f} ms", flush=True)
    print(f"probe: manual_fixed (again) {1000 * manual(module, same, device):.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
