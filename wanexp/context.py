"""The run context: the run-wide facts that the module, the datamodule and the callbacks read the same way.

``wanexp.train`` builds one ``RunContext`` from the config and hands it to the module and the datamodule (constructor
argument) and to the callbacks that read it (``hand_over``, once, before the fit). It holds the config's facts;
the process facts (ranks) exist only once Lightning's strategy has set up the process group, after these parts are
built, so they are read when asked, from the trainer the asking part is attached to (``None``: one process).
Lightning's private parts are read in ``wanexp.lightning_compat`` only.
"""
from __future__ import annotations

from dataclasses import dataclass

from wanexp import lightning_compat


@dataclass(frozen=True)
class RunContext:
    """``sp_size``: the ranks of one sequence-parallel group, which share each sample (``parallel.sp_size``);
    ``concurrent_loads``: ranks per node that read the base into host memory at a time (``parallel.concurrent_loads``;
    None: derived from the free host memory)."""

    sp_size: int = 1
    concurrent_loads: int | None = None

    def __post_init__(self):
        if int(self.sp_size) < 1:
            raise ValueError(f"sp_size={self.sp_size}: a sequence-parallel group holds at least one rank")

    @classmethod
    def from_config(cls, cfg) -> RunContext:
        """The context of a composed run config (its ``parallel`` group)."""
        p = cfg.parallel
        loads = None if p.concurrent_loads is None else int(p.concurrent_loads)
        return cls(sp_size=int(p.sp_size), concurrent_loads=loads)

    @staticmethod
    def rank(trainer) -> int:
        """The global rank (0 without a trainer)."""
        return 0 if trainer is None else int(trainer.global_rank)

    @staticmethod
    def world_size(trainer) -> int:
        """The processes of the run (1 without a trainer)."""
        return 1 if trainer is None else int(trainer.world_size)

    def dp_rank(self, trainer) -> int:
        """The data-parallel rank: the ranks of one sequence-parallel group share it (and so their batches)."""
        return self.rank(trainer) // self.sp_size

    def dp_size(self, trainer) -> int:
        """The data-parallel ranks: world size / sp_size (the world is a multiple of sp_size: config/rules.py);
        1 without a trainer."""
        return max(1, self.world_size(trainer) // self.sp_size)

    @staticmethod
    def logs_this_step(trainer) -> bool:
        """Whether the current step logs (``trainer.log_every_n_steps``): what is read from the device for the logs
        is read at these steps only. False without a trainer (nothing is logged)."""
        return trainer is not None and lightning_compat.logs_this_step(trainer)


class TakesRunContext:
    """A part that Hydra builds from the config (a callback) and that reads the run context: ``hand_over`` gives it
    the run's context once, before the fit; until then it reads the one-process default."""

    run_context: RunContext = RunContext()

    def attach_run_context(self, context: RunContext) -> None:
        self.run_context = context


def hand_over(context: RunContext, parts) -> None:
    """Give the run's context to every part that takes one."""
    for part in parts:
        if isinstance(part, TakesRunContext):
            part.attach_run_context(context)
