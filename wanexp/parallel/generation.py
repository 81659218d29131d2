"""Generation on several processes: ``wanexp-sample --gpus N`` (which launches the N processes itself) or
``torchrun --nproc_per_node=N -m wanexp.cli.sample ...``.

The ranks form a grid of ``cfg`` x ``sp`` (rank = c * sp + s):

- **sequence parallel** (``--sp``): the ``sp`` consecutive ranks of one CFG branch split every transformer call's
  video tokens between them (Ulysses, as in training: models/sequence.py); each ends the call with the whole output.
- **CFG parallel** (``--cfg-parallel``): the ranks with c = 0 run every step's conditional call, those with c = 1 its
  unconditional one, at the same time; the two outputs are exchanged once per step (:func:`cfg_split`), so no rank
  runs both and nothing is exchanged inside the transformer.

Every rank draws the same noise from the sample's seed and ends each step with the same latents; each decodes them
(the GPUs' memory peaks stay equal) and rank 0 writes. Nothing collective happens while a rank builds or loads its
modules: each loads its own copy, or with ``--shard`` its own shards (wanexp.models.sharded), onto its own device
(never all onto GPU 0). Each phase ends at a barrier of a gloo group with the run's timeout (:func:`arrive`):
a rank that does not arrive in time is named in one line with the phase, instead of a silent hang.

The launcher (:func:`launch`) starts the N processes on this host, keeps every rank's phase and first error line in
a temporary folder, stops the others when one fails, and prints one line: the first rank's error, or which rank
exited how during which phase (a crashed rank's log tail with it).
"""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from wanexp.errors import ConfigError

LAUNCH_DIR = "WANEXP_LAUNCH_DIR"  # set by launch() for its processes: where each writes its phase and error line


class RankFailure(RuntimeError):
    """A rank that did not arrive, or a collective that failed: the one line that says which and when."""


@dataclass(frozen=True)
class Layout:
    cfg: int  # 1, or 2 with --cfg-parallel
    sp: int

    @property
    def world(self) -> int:
        return self.cfg * self.sp


def layout(world: int, sp: int | None, cfg_parallel: bool) -> Layout:
    """The grid of ``world`` processes: ``--sp`` (default: every process not taken by CFG parallel) times 2 with
    ``--cfg-parallel``. A grid that is not the process count is one line."""
    cfg = 2 if cfg_parallel else 1
    if sp is not None and sp < 1:
        raise ConfigError(f"--sp {sp}: the sequence-parallel size is a positive number of processes")
    if sp is None:
        if world % cfg:
            raise ConfigError(f"--cfg-parallel with {world} process(es): CFG parallel needs an even number of "
                              "processes (the conditional and unconditional halves)")
        sp = world // cfg
    if cfg * sp != world:
        want = f"{cfg} x {sp} = {cfg * sp}" if cfg > 1 else str(sp)
        how = ("add --gpus N (or run it under torchrun --nproc_per_node=N)" if world == 1
               else f"run {cfg * sp} processes, or pass --sp {world // cfg}")
        raise ConfigError(f"--sp {sp}{' --cfg-parallel' if cfg > 1 else ''} needs {want} processes, not {world}; "
                          f"{how}")
    return Layout(cfg, sp)


def check_split(tokens: int | None, heads: int, sp: int) -> None:
    """The sequence split of a sample of ``tokens`` DiT tokens (None: a family that pads its sequence) through
    ``heads`` attention heads over ``sp`` ranks, checked before any weight loads."""
    if sp == 1:
        return
    if heads % sp:
        ok = [d for d in range(2, heads + 1) if heads % d == 0][:6]
        raise ConfigError(f"--sp {sp}: the model's {heads} attention heads do not divide by {sp}; use --sp "
                          f"{' or '.join(map(str, ok))} (with that many processes, or add --cfg-parallel)")
    if tokens is not None and tokens % sp:
        raise ConfigError(f"--sp {sp}: a sample of {tokens} DiT tokens does not split into {sp} equal parts; pick "
                          f"--height/--width/--frames whose token count divides by {sp}")


@dataclass
class Grid:
    """This process's place in the generation grid."""

    layout: Layout
    rank: int
    device: object  # torch.device
    control: object  # a gloo group: barriers with the run's timeout, the prompts' embeddings
    sp_group: object  # wanexp.models.sequence.SequenceGroup of this CFG branch, or None (sp = 1)
    cfg_group: object  # the process group of this rank's CFG pair, or None
    timeout_s: int

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.layout.sp

    @property
    def leader(self) -> bool:
        return self.rank == 0


def set_phase(name: str) -> None:
    """Record this process's phase for the launcher (nothing without one)."""
    folder = os.environ.get(LAUNCH_DIR)
    if folder:
        (Path(folder) / f"phase{os.environ.get('RANK', '0')}").write_text(name)


def launched() -> bool:
    return bool(os.environ.get(LAUNCH_DIR))


def report(line: str) -> None:
    """A failing rank's one line: into the launcher's folder (it prints the first), else on stderr."""
    folder = os.environ.get(LAUNCH_DIR)
    if folder:
        rank = os.environ.get("RANK", "0")
        path = Path(folder) / f"error{rank}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(line)
        tmp.replace(path)
    else:
        from wanexp.errors import say_error

        say_error(line)


def start(device: str | None, lay: Layout, timeout_s: int) -> Grid | None:
    """Join the generation grid ``lay`` (:func:`layout`) of this process's launch (torchrun's or :func:`launch`'s
    environment): None for a single process. Each rank uses GPU ``LOCAL_RANK``."""
    world = lay.world
    if world == 1:
        return None
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    cuda = device != "cpu" and torch.cuda.is_available()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    set_phase("startup")
    try:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **({"device_id": dev} if cuda else {}))
        control = dist.new_group(backend="gloo", timeout=timeout)
        sp_group = cfg_group = None
        if lay.sp > 1:
            from wanexp.models.sequence import build_group

            sp_group = build_group(lay.sp)
        if lay.cfg > 1:  # pairs (s, sp + s); new_group is collective: every rank makes every pair
            for s in range(lay.sp):
                g = dist.new_group([s, lay.sp + s])
                if rank % lay.sp == s:
                    cfg_group = g
    except (RuntimeError, TimeoutError) as e:  # DistStoreError and gloo's connect timeouts are RuntimeErrors
        raise RankFailure(f"rank {rank}: the {world} processes did not all start within {timeout_s} s (phase "
                          f"'startup': {first_line(e)}); check that every process was launched, or raise "
                          "--timeout") from None
    grid = Grid(lay, rank, dev, control, sp_group, cfg_group, timeout_s)
    arrive(grid, "startup")
    return grid


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def arrive(grid: Grid | None, phase: str) -> None:
    """End ``phase``: wait for every rank (gloo's monitored barrier, the run's timeout). A rank that does not arrive
    in time is named in a RankFailure."""
    if grid is None:
        return
    import torch.distributed as dist

    set_phase(f"{phase} (done, waiting for the other ranks)")
    try:
        dist.monitored_barrier(group=grid.control, timeout=timedelta(seconds=grid.timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        late = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))
        who = f"rank(s) {late.group(1).strip()}" if late else "a rank"
        raise RankFailure(f"rank {grid.rank}: {who} did not finish '{phase}' within {grid.timeout_s} s (a rank that "
                          "died, hangs or is much slower); see that rank's output, or raise --timeout") from None
    set_phase(f"after {phase}")


def gather(grid: Grid | None, value) -> list:
    """Every rank's ``value`` (picklable), in rank order, on every rank; ``[value]`` for one process."""
    if grid is None:
        return [value]
    import torch.distributed as dist

    out = [None] * grid.world
    try:
        dist.all_gather_object(out, value, group=grid.control)
    except RuntimeError as e:
        raise RankFailure(f"rank {grid.rank}: the other ranks' data did not come within {grid.timeout_s} s ("
                          f"{first_line(e)}); see their output, or raise --timeout") from None
    return out


@contextmanager
def cfg_split(grid: Grid | None, modules, negative, guidance: float, mode: str | None = "text"):
    """CFG parallel over the pipeline's transformer calls: a pipeline with guidance > 1 calls each step's
    transformer twice, conditional then unconditional, on the same latents. Inside this block the rank of CFG branch
    1 runs the first call on ``negative`` (the negative prompt's embeddings), branch 0 on the prompt; the two outputs
    are exchanged and the second call returns the other branch's output without computing. ``modules``: the
    pipeline's transformers. Nothing changes without a CFG grid, with guidance <= 1 (one call per step) or for a
    pipeline that splits its own pairs (``mode`` "pairs": ModelSpec.cfg_parallel, Pipeline.cfg_pair)."""
    if grid is None or grid.layout.cfg == 1 or guidance <= 1.0 or mode != "text":
        yield
        return
    from wanexp.models.pipeline import cfg_pair

    pending: list = []

    def split(inner):
        def forward(*args, **kw):
            hidden = kw.get("hidden_states")
            if args or hidden is None or kw.get("return_dict", True):
                raise RuntimeError("cfg_split: the pipeline called its transformer with positional arguments or "
                                   "return_dict; the CFG pairing of its calls cannot be followed")
            if pending:  # the step's unconditional call: computed by branch 1 during the conditional one
                same, out = pending.pop()
                if same is not hidden:
                    raise RuntimeError("cfg_split: a transformer call that is not the unconditional half of the "
                                       "previous call's step")
                return (out,)
            text = kw["encoder_hidden_states"]
            unconditional = dict(kw, encoder_hidden_states=negative.to(text.device, text.dtype).expand_as(text))
            cond, uncond = cfg_pair(grid, lambda: inner(**kw)[0], lambda: inner(**unconditional)[0])
            pending.append((hidden, uncond))
            return (cond,)
        return forward

    saved = [(m, m.__dict__.get("forward")) for m in modules]
    for m in {id(m): m for m in modules}.values():
        m.forward = split(m.forward)
    try:
        yield
    finally:
        for m, f in saved:
            if f is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = f
    if pending:
        raise RuntimeError("cfg_split: a step's unconditional call never came")


def finish(grid: Grid | None) -> None:
    if grid is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


# ---- the launcher -------------------------------------------------------------------------------------------------
def launch(argv: list[str], processes: int) -> int:
    """Run ``python -m wanexp.cli.sample argv`` as ``processes`` ranks on this host and wait for them; returns the exit
    code. Rank 0's output is this command's (its stderr, which the libraries' progress bars and the collectives'
    own messages fill, only when it crashes); the others' goes to their logs. When a rank fails, the others are
    stopped and one line says why."""
    import signal
    import socket
    import subprocess
    import tempfile
    import time

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = Path(tempfile.mkdtemp(prefix="wanexp-sample-"))
    procs, logs = [], []
    try:
        for rank in range(processes):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                       LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       **{LAUNCH_DIR: str(folder)})
            log = open(folder / f"rank{rank}.log", "w")  # rank 0's stdout is this command's; its stderr too here
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "wanexp.cli.sample", *argv], env=env,
                                          stdout=None if rank == 0 else log, stderr=log))
        codes = [p.poll() for p in procs]
        while None in codes and not any(codes):  # until all are done or one has failed
            time.sleep(0.1)
            codes = [p.poll() for p in procs]
        failed = next((r for r, code in enumerate(codes) if code), None)
        if failed is None:
            return 0
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return _say_failure(folder, procs, failed)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise
    finally:
        for log in logs:
            if log:
                log.close()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _say_failure(folder: Path, procs, failed: int) -> int:
    """The launcher's one line for a failed launch; its exit code (2: a refusal, else 1)."""
    from wanexp.errors import say_error

    errors = sorted(folder.glob("error*"), key=lambda p: p.stat().st_mtime)
    if errors:  # the first rank to say what went wrong
        code = procs[int(errors[0].name[5:])].returncode
        say_error(errors[0].read_text().strip())
        return 2 if code == 2 else 1
    code = procs[failed].returncode
    phase_file = folder / f"phase{failed}"
    phase = phase_file.read_text() if phase_file.is_file() else "startup"
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    log = folder / f"rank{failed}.log"
    tail = log.read_text().strip().splitlines()[-20:] if log.is_file() else []
    if tail and any("Traceback" in line for line in tail) or (tail and code > 0):
        print("\n".join(tail), file=sys.stderr)
    say_error(f"rank {failed} {how} during '{phase}'; the other ranks were stopped")
    return 1
