"""What a model family's sampling pipeline offers the shared sampling code (wanexp.generation, cli/sample.py, the
validation callback): the base class a family's ``ModelSpec.load_pipeline`` / ``ModelSpec.make_pipeline`` return."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def cfg_pair(grid, cond, uncond):
    """A CFG step's (conditional, unconditional) outputs from two calls without arguments: both here, or with CFG
    parallel (``grid``: wanexp.parallel.generation.Grid with two CFG branches) each on its branch's processes, then
    exchanged, so every process ends with both."""
    if grid is None or grid.layout.cfg == 1:
        return cond(), uncond()
    import torch
    import torch.distributed as dist

    mine = (cond if grid.cfg_rank == 0 else uncond)().contiguous()
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine, group=grid.cfg_group)
    return both[0], both[1]


class Pipeline:
    """A family's sampling pipeline around loaded modules (what ``ModelSpec.load_pipeline`` and
    ``ModelSpec.make_pipeline`` return). ``experts``: expert name -> transformer, as the pipeline holds them. A
    family's pipeline implements every method; one it lacks says so when the shared code reaches it."""

    experts: dict
    boundary_ratio: float | None = None  # the model's own (a folder's model_index.json), for expert_routing
    grid = None  # this process's place when several generate together (wanexp.parallel.generation.Grid)

    def cfg_pair(self, cond, uncond):
        """A CFG step's (conditional, unconditional) outputs from two calls without arguments (:func:`cfg_pair` on
        this pipeline's ``grid``: ModelSpec.cfg_parallel = "pairs")."""
        return cfg_pair(self.grid, cond, uncond)

    def generate(self, prompt: str, seed: int, shape: dict, steps: int, guidance: float, negative: str, device,
                 record: list, image=None, embeds=None, inputs: dict | None = None):
        """One sample: (latents fp32 on the CPU, video (F, H, W, 3) in [0, 1] on the CPU, the timesteps recorded).
        ``shape``: height, width, frames, text_len. ``image``: the first frame (PIL) of an image-to-video sample.
        ``embeds``: the (prompt, negative prompt) text embeddings, each (text_len, D), for a pipeline built without
        its text encoder (validation reads them from the cache). The same seed gives the same sample. On several
        processes every one runs it whole (each decodes: their memory peaks stay equal). The transformers are
        called through ``nn.Module.__call__`` with keyword arguments, the conditional call of a CFG step before its
        unconditional one (wanexp.parallel.generation.cfg_split relies on it). ``inputs``: the family's own inputs
        of this sample by name (``ModelSpec.sample_inputs``, e.g. ``{"audio": path}``: ``wanexp-sample --audio``)."""
        raise self._missing("generate")

    def soundtrack(self, inputs: dict | None, frames: int, fps: int):
        """The audio to mux into a sample's mp4 (``(samples float32 mono, rate)``), or None: a silent video."""
        return None

    def recorded_timesteps(self):
        """A context manager: collect the timestep each transformer call gets into the list it yields (cleared by
        :meth:`generate`); the recording stops on exit."""
        raise self._missing("recorded_timesteps")

    def routed(self, routing):
        """A context manager: run the pipeline's steps over its experts by ``routing``
        (wanexp.generation.ExpertRouting); restored on exit."""
        raise self._missing("routed")

    def load_adapter(self, path: Path, adapter_name: str, expert: str) -> str:
        """Load an adapter file into ``expert``'s transformer as ``adapter_name``; returns the call that loaded it."""
        raise self._missing("load_adapter")

    def adapters_on(self, on: bool) -> None:
        """Switch the loaded adapters on or off (the teacher of ``wanexp-sample --teacher`` runs without them)."""
        raise self._missing("adapters_on")

    def use_student(self, timesteps: list[float] | None, shift: float = 0.0) -> None:
        """Sample on exactly these student timesteps (a distilled adapter), re-noising from each sample's seed; None:
        the pipeline's own scheduler again."""
        raise self._missing("use_student")

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} (a family's sampling pipeline) provides no {what}")


class OneExpertPipeline(Pipeline):
    """The parts of a pipeline of one dense expert (``spec`` and ``experts`` set by the subclass) whose adapters are
    peft's under the family's names: no routing, adapter files read by ``wanexp.adapters.load_adapter_file``, the
    recorded timesteps filled by the subclass's ``generate`` into the list it is given."""

    @contextmanager
    def recorded_timesteps(self):
        yield []  # generate fills it

    @contextmanager
    def routed(self, routing):
        yield  # one expert serves every step

    def load_adapter(self, path, adapter_name, expert):
        from wanexp.adapters import load_adapter_file

        load_adapter_file(self.experts[expert], path, self.spec.adapter_naming, adapter_name, what=f"--lora {path}")
        return "wanexp.adapters.load_adapter_file"

    def adapters_on(self, on: bool) -> None:
        for t in self.experts.values():
            (t.enable_adapters if on else t.disable_adapters)()
