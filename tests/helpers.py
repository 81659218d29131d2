"""Components that tests plug in through the config's swap points (``_target_``), as a user would."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.config.schema import FlowMatchingConfig
from wanexp.objectives.base import Objective, ObjectiveOutput
from wanexp.objectives.flow_matching import FlowMatching, masked_mse


class GradNormProbe(Callback):
    """Records the total norm of the trainable gradients as the optimizer sees them (after clipping; Lightning runs the backward inside optimizer.step, so this is a post-step hook)."""

    def __init__(self):
        self.norms: list[float] = []
        self.handles = []

    def on_train_start(self, trainer, pl_module) -> None:
        def record(optimizer, args, kwargs):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

        self.handles = [opt.register_step_post_hook(record) for opt in trainer.optimizers]

    def on_train_end(self, trainer, pl_module) -> None:
        for h in self.handles:
            h.remove()


class CleanLatentObjective(Objective):
    """A toy objective written the way a newcomer would add one: predict the clean latent at one fixed sigma."""

    def __init__(self, name: str = "clean_latent", sigma: float = 0.5):
        super().__init__(name)
        self.sigma = sigma

    def __call__(self, batch, denoiser, generator=None, *, step: int = 0, negative_text=None) -> ObjectiveOutput:
        x0 = batch.x0
        sigma = torch.full((batch.size,), self.sigma, device=x0.device)
        noise = torch.randn_like(x0)
        pred = denoiser((1 - self.sigma) * x0 + self.sigma * noise, sigma, batch)
        per_sample = masked_mse(pred.velocity, x0, pred.loss_mask)
        return ObjectiveOutput(per_sample.mean(), batch.size, {"train/clean_latent_mse": (per_sample.mean().detach(),
                                                                                          batch.size)})


class BatchRecorder(Callback):
    """Records the dataset indices of every training batch (per rank; appended to ``path`` if given)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        idx = batch["index"].tolist()
        self.batches.append(idx)
        if self.path:
            import json

            with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch, "index": idx}) + "\n")


class _CountedFrame:
    def __init__(self, frame, index: int, converted: list[int]):
        self._frame, self._index, self._converted = frame, index, converted

    def __getattr__(self, name: str):
        return getattr(self._frame, name)

    def to_ndarray(self, *args, **kwargs):
        self._converted.append(self._index)
        return self._frame.to_ndarray(*args, **kwargs)


class CountingContainer:
    """Wraps a PyAV container: frames decoded (``decoded``), which of them were converted to arrays (``converted``,
    by decode index) and whether it was closed (``closed``)."""

    def __init__(self, container):
        self._container = container
        self.decoded, self.converted, self.closed = 0, [], False

    def __getattr__(self, name: str):
        return getattr(self._container, name)

    def __enter__(self) -> "CountingContainer":
        return self

    def __exit__(self, *exc) -> None:
        self._container.close()
        self.closed = True

    def decode(self, *args, **kwargs):
        for frame in self._container.decode(*args, **kwargs):
            self.decoded += 1
            yield _CountedFrame(frame, self.decoded - 1, self.converted)


def count_decoding(monkeypatch, av_module) -> list[CountingContainer]:
    """Make ``av_module.open`` return CountingContainers; returns the list of those opened."""
    opened: list[CountingContainer] = []
    real_open = av_module.open

    def counting_open(*args, **kwargs):
        opened.append(CountingContainer(real_open(*args, **kwargs)))
        return opened[-1]

    monkeypatch.setattr(av_module, "open", counting_open)
    return opened


class _NaNGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient backward (a finite loss whose gradients blew up)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


@dataclass
class FaultyFlowMatchingConfig(FlowMatchingConfig):
    weighting: str = "none"
    nan_loss_at: List[int] = field(default_factory=list)
    nan_grad_at: List[int] = field(default_factory=list)


class FaultyFlowMatching(FlowMatching):
    """Flow matching that goes non-finite on chosen calls (1-based): a NaN loss, or a NaN gradient."""

    schema = FaultyFlowMatchingConfig

    def __init__(self, *, nan_loss_at=(), nan_grad_at=(), **kwargs):
        super().__init__(**kwargs)
        self.nan_loss_at, self.nan_grad_at = set(nan_loss_at), set(nan_grad_at)
        self.calls = 0

    def __call__(self, batch, denoiser, generator=None, *, step: int = 0, negative_text=None):
        self.calls += 1
        out = super().__call__(batch, denoiser, generator, step=step, negative_text=negative_text)
        if self.calls in self.nan_loss_at:
            out.loss = out.loss * float("nan")
        if self.calls in self.nan_grad_at:
            out.loss = _NaNGrad.apply(out.loss)
        return out


class ExpertProbe(Callback):
    """Records, per optimizer step, which expert transformers ran a forward on this rank and the denoiser's forced
    expert after the step (``{path}.rank<r>``, JSON lines ``{"step", "experts", "routing_after_step"}``)."""

    def __init__(self, path: str):
        self.path, self.ran, self.handles = path, set(), []

    def on_train_start(self, trainer, pl_module) -> None:
        for name, t in pl_module.transformers.items():
            self.handles.append(t.register_forward_pre_hook(lambda *_, n=name: self.ran.add(n)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import json

        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "experts": sorted(self.ran),
                                "routing_after_step": pl_module.denoiser.step_expert}) + "\n")
        self.ran = set()

    def on_train_end(self, trainer, pl_module) -> None:
        for h in self.handles:
            h.remove()


class SignalAtStep(Callback):
    """Sends ``signum`` to its own process (of rank ``rank`` only, when given) at the end of optimizer step ``step``,
    after the callbacks before it have run their step-end hooks (a signal landing late in a step)."""

    def __init__(self, step: int, signum: int = 15, rank: int | None = None):
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import os

        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


class StepTimer(Callback):
    """``+callbacks.timer._target_=tests.helpers.StepTimer +callbacks.timer.start=S +callbacks.timer.steps=N``: the
    mean wall time of optimizer steps S+1 .. S+N, the GPU synchronized at both ends and nothing else touched (no
    profiler), printed as one line ``wanexp-timer: steps A-B mean X ms``. For A/B runs of the training loop's host
    settings (the GPU cases gap_5b and host_gap_5b)."""

    def __init__(self, start: int, steps: int):
        self.start, self.steps, self.t0, self.mean_s = start, steps, None, None

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        if self.t0 is None and trainer.global_step == self.start:
            self._sync(pl_module)
            self.t0 = time.perf_counter()
        elif self.t0 is not None and trainer.global_step == self.start + self.steps:
            self._sync(pl_module)
            self.mean_s = (time.perf_counter() - self.t0) / self.steps
            print(f"wanexp-timer: steps {self.start + 1}-{self.start + self.steps} mean {1000 * self.mean_s:.1f} ms",
                  flush=True)


class CliRun:
    """``python train.py ARGS`` started as tests.conftest.run_cli starts it, without waiting for it: for runs of a
    test that do not depend on each other (a multi-process run leaves a core idle while its later ranks import and
    while its processes exit). Its stdout and stderr go to files in ``folder``; ``result()`` waits for it."""

    def __init__(self, args: list[str], folder, env: dict | None = None):
        import os
        import subprocess
        import sys
        from pathlib import Path

        from tests.conftest import ROOT

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.out, self.err = folder / "stdout.txt", folder / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=out,
                                         stderr=err, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

    def result(self, timeout: float = 300):
        """The finished run as a subprocess.CompletedProcess (returncode, stdout, stderr); killed past ``timeout``."""
        import subprocess

        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return subprocess.CompletedProcess(self.proc.args, code, self.out.read_text(), self.err.read_text())


def record_condition_channels(monkeypatch, first: int) -> list:
    """Every transformer call's input channels from ``first`` on (an I2V-A14B sample's mask and image condition),
    recorded while ``wanexp.models.wan22.pipeline.generate`` runs: the list they are appended to."""
    from wanexp.models.wan22 import pipeline

    seen: list = []
    generate = pipeline.generate

    def spy(pipe, *args, **kwargs):
        hooks = [m.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"][:, first:].clone()),
                                             with_kwargs=True) for m in (pipe.transformer, pipe.transformer_2)]
        try:
            return generate(pipe, *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr("wanexp.models.wan22.pipeline.generate", spy)
    return seen


def assert_samples_refused(cases, capsys, out) -> None:
    """Each ``(args, expected)`` of ``cases`` given to wanexp-sample (one prompt, on the CPU, into ``out``) exits 2
    with one line starting ``wanexp: error: <expected>``, and nothing is written to ``out``."""
    import pytest

    from wanexp.cli import sample

    for args, expected in cases:
        with pytest.raises(SystemExit) as e:
            sample.main([*args, "--prompt", "x", "--device", "cpu", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"wanexp: error: {expected}") and err.count("\n") == 1, err
    assert not out.exists()
