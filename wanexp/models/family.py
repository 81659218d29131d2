"""What a model family provides, and the part of a model spec that is the same for every family.

A family is a package (``wanexp/models/wan22/`` for Wan2.2) with one :class:`ModelSpec` subclass per layout; a model
YAML (``conf/model/*.yaml``) names that class as its ``_target_`` and gives the ``model`` group's values
(config.schema.ModelConfig) to its constructor. The rest of wanexp calls only the methods and reads only the
attributes defined here, so a family is added without editing any file outside its package and its YAML
(docs/extending.md, tests/unit/test_model_family.py).

A family sets the class attributes (layout, channels, strides, the component classes) and implements
:meth:`ModelSpec.model_inputs` (the DiT input of a training sample) and :meth:`ModelSpec.write_random_model` (its tiny
random build, for tests). Components are loaded from a local diffusers-format folder: ``model_index.json`` and one
subfolder per component (each expert's, ``ModelSpec.expert_folders``, and the encoders', ``encoder_folders``); a
family with ``component_files`` also takes them one by one (``model.transformer_path`` ..., single weight files or
component folders: ``read_transformer``, ``load_vae``, ``load_text_encoder``, ``load_tokenizer``, ``encoder_source``).
The rest of the protocol is in one section a part, each with defaults that fit one dense expert: adapters (the
adapter naming), conditioning (experts and routing, encoders, per-sample inputs, the transformer call, blocks,
sequence parallel), shapes, memory and FLOPs (the memory and FLOP formulas, the family's own config checks; the
frame rule is the model YAML's ``frame_rule``), and generation, bench and conversion (the sampling pipeline, the plain
reference loop, converters).
"""
from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from wanexp.config.rules import missing_model_folder
from wanexp.config.schema import DTYPES
from wanexp.errors import ConfigError
from wanexp.models.attention import check_attention_backend, set_attention_backend

@dataclass(frozen=True)
class EncoderInfo:
    """What identifies a model's encoders and latent grid: the cache keys' inputs and the DiT token count."""

    vae: str  # the VAE's folder
    vae_dtype: str
    layout: str  # the spec's layout (latents of two layouts never share a cache key)
    text_encoder: str  # the text encoder's folder
    text_dtype: str
    tokenizer: str  # the tokenizer's folder
    text_len: int  # tokens per prompt the DiT sees
    # what the encoders store per sample besides the latents (their cond), a JSON value of the latent cache keys:
    # entries encoded for other conditioning are never shared (ModelSpec.needs_image_latent: a first frame's latent)
    cond_id: object
    vae_stride: tuple[int, int, int]  # pixels per latent (frames, height, width)
    patch: tuple[int, int, int]  # latents per DiT token (frames, height, width)
    fps: int | None = None  # the native frame rate: training clips are resampled to it unless data.fps says otherwise
    frame_rule: tuple[int, int] = (1, 0)  # a sample's frame count n keeps n % m == r (ModelSpec.frame_rule)
    sample_inputs: tuple[str, ...] = ()  # the family's extra metadata columns (ModelSpec.sample_inputs)
    # ModelSpec.load_sample_input(name, path, num_frames, fps, size, start, stride) -> Tensor: reads one sample input
    # (None: none)
    load_sample_input: Callable | None = None
    # the folders of the family's other media encoders (encoder_folders besides the VAE, the text encoder and the
    # tokenizer: e.g. an audio encoder), whose weights the latent cache keys cover too
    media_encoders: tuple[str, ...] = ()
    # ModelSpec.sample_input_fallbacks as ((input, (other columns, ...)), ...)
    input_fallbacks: tuple = ()
    # ModelSpec.check_sample_input(name, path) -> a reject reason or None, run by the data probe (None: no check)
    check_sample_input: Callable | None = None
    pads_sequence: bool = False  # ModelSpec.pads_sequence: any token count splits over parallel.sp_size ranks


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth")
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes: safetensors' own limit on the JSON header


def require_frame_stride_one(data: dict, why: str) -> None:
    """The ``data`` group of a family whose clips keep every frame at their rate (e.g. one audio feature per frame):
    ``data.frame_stride=1``, else one line saying why and what to set."""
    if int(data.get("frame_stride") or 1) != 1:
        raise ConfigError(f"data.frame_stride={data.get('frame_stride')}: {why}; set data.frame_stride=1 and "
                          "data.fps to the rate wanted")


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a component's folder (safetensors, or torch's .bin/.pth)."""
    return sorted(f for f in Path(folder).glob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file, found from its header alone, or None: the 8-byte length of the JSON
    header, the header itself, each tensor's ``data_offsets``, and a data section of exactly the size they span (what
    safetensors checks when it opens a file; a truncated download holds less)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or n > size - 8:
            return f"{size:,} bytes, too short for the header it announces (truncated, or not a safetensors file)"
        if n > SAFETENSORS_MAX_HEADER:
            return f"a header of {n:,} bytes announced, above safetensors' limit (not a safetensors file)"
        try:
            header = json.loads(f.read(n))
        except ValueError:  # bytes that are not JSON (UnicodeDecodeError included)
            header = None
    if not isinstance(header, dict):
        return "its header is not a safetensors header (damaged, or another format)"
    ends = []
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if name != "__metadata__":
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                return f"its header gives tensor {name} no valid data_offsets (damaged)"
            ends.append(offsets[1])
    data, need = size - 8 - n, max(ends, default=0)
    if data < need:
        return f"truncated: it holds {data:,} of the {need:,} bytes of tensor data its header describes"
    if data > need:
        return f"{data - need:,} bytes more than the {need:,} of tensor data its header describes (damaged)"
    return None


def unreadable_weights(path: Path, what: str, reason: str) -> ConfigError:
    """The one line for weights that cannot be read (corrupt or truncated: what a partial download leaves)."""
    reason = " ".join(str(reason).split())[:300]
    return ConfigError(f"model.path={path}: cannot read {what} ({reason}); a weight file there is corrupt or "
                       "incomplete: download (or convert) it again")


def load_class(dotted: str) -> type:
    """The class named ``package.module.Class`` (a spec names its component classes this way: nothing heavy is
    imported before a component loads)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def spec_class(group: str, flag: str) -> type:
    """The spec class of model group ``group`` (``conf/model/<group>.yaml``), for a command that names a model
    group with ``flag``; a name with no such group is one line naming ``flag``."""
    from wanexp.config import model_group

    return load_class(str(model_group(group, flag)._target_))


class ModelSpec:
    """A model layout: its folder, its components, how a noise level picks an expert and how a sample becomes the
    DiT's input. Subclasses set the class attributes and implement ``model_inputs`` and ``write_random_model``."""

    layout: str = ""  # a short name, part of the cache keys
    latent_channels: int = 16  # channels of the VAE's latents (what the DiT predicts)
    in_channels: int = 16  # channels of the DiT's input (latents plus any conditioning channels)
    vae_stride: tuple[int, int, int] = (4, 8, 8)  # pixels per latent (frames, height, width)
    patch: tuple[int, int, int] = (1, 2, 2)  # latents per DiT token (frames, height, width)
    extra_latent_frames: int = 0  # latent frames the DiT sees besides the clip's (Animate's reference slot)
    # the family splits a forward's tokens over parallel.sp_size / wanexp-sample --sp ranks (enable_sequence_parallel)
    sequence_parallel: bool = False
    compiles_blocks: bool = False  # model.compile compiles the family's blocks (prepare_transformer)
    needs_image_latent: bool = False  # every sample carries its first frame's latent (image-to-video)
    draws_first_frame: bool = False  # a fraction of samples keep a clean latent frame 0 (model.first_frame_cond)
    reference_image: bool = False  # samples from a reference image (wanexp-sample --image, optional): S2V
    per_token_timestep: bool = False  # the DiT takes a timestep per token, not one per sample
    draws_audio_dropout: bool = False  # a share of samples train with zeroed audio features (model.audio_dropout)
    modes: tuple[str, ...] = ()  # the values model.animate_mode takes (none: the family has no modes)
    default_audio_dropout: float = 0.0  # that share when model.audio_dropout is null
    # The components, as ``package.module.Class`` (diffusers/transformers classes with from_pretrained).
    transformer_class: str = ""
    vae_class: str = ""
    text_encoder_class: str = ""
    tokenizer_class: str = "transformers.AutoTokenizer"
    # whether the family loads components given one by one (model.transformer_path, model.vae_path, ...: single
    # weight files or component folders) besides the model.path folder
    component_files: bool = False

    def __init__(
        self,
        *,
        name: str,
        path: str | None,
        dtype: str,
        vae_dtype: str,
        text_encoder_dtype: str,
        experts: list[str],
        boundary_ratio: float | None,
        shift: float,
        hw_multiple: int,
        text_len: int,
        fps: int,
        gradient_checkpointing: bool,
        attention_backend: str | None,
        first_frame_cond: float,
        build: dict | None,
        fast_modulation: bool,
        compile: bool,
        memory_budget_gib: float | None,
        fp8: bool = False,
        compile_checkpoint: bool = True,
        cuda_graphs: bool = False,
        fp8_storage: bool = False,
        blocks_to_swap: int | None = None,
        offload_activations: bool = False,
        selective_checkpointing: bool | None = None,
        frame_rule: list[int] | None = None,
        audio_dropout: float | None = None,
        animate_mode: str | None = None,
        transformer_path: str | None = None,
        transformer_2_path: str | None = None,
        vae_path: str | None = None,
        text_encoder_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        """The arguments are the ``model`` group (conf/model/*.yaml, typed by config.schema.ModelConfig)."""
        self.name = name
        self.path = Path(path) if path is not None else None
        # components given one by one (model.<component>_path: a single weight file or the component's folder)
        # keyed by the model group's key
        self.component_paths = {"transformer_path": transformer_path, "transformer_2_path": transformer_2_path,
                                "vae_path": vae_path, "text_encoder_path": text_encoder_path,
                                "tokenizer_path": tokenizer_path}
        given = [f"model.{k}" for k, v in self.component_paths.items() if v is not None]
        if self.path is None or self.path.is_file():
            given.append(f"model.path={path}")
        if given and not self.component_files:
            raise ConfigError(f"{', '.join(given)}: model={name} loads its weights from a model.path folder only; "
                              "point model.path at its folder (and leave the component paths unset)")
        self.dtype, self.vae_dtype, self.text_encoder_dtype = (
            getattr(torch, DTYPES[d]) for d in (dtype, vae_dtype, text_encoder_dtype))
        self.experts = list(experts)
        self.boundary_ratio = boundary_ratio
        self.shift = shift
        self.hw_multiple = hw_multiple
        self.frame_rule = tuple(frame_rule or (1, 0))  # a sample's frame count n keeps n % m == r (model.frame_rule)
        self.text_len = text_len
        self.fps = fps  # native frame rate: clips are resampled to it, generated videos written at it
        self.gradient_checkpointing = gradient_checkpointing
        self.attention_backend = attention_backend
        self.first_frame_cond = first_frame_cond
        self.build = build
        self.fast_modulation = fast_modulation  # time embedding + block modulation per latent frame (the family's)
        self.compile = compile  # torch.compile each transformer block (regional compilation)
        self.compile_checkpoint = compile_checkpoint  # the checkpoint inside the compiled graph
        self.cuda_graphs = cuda_graphs  # the compiled blocks replayed as CUDA graphs (config.rules.check_cuda_graphs)
        self.memory_budget_gib = memory_budget_gib  # checkpoint only the blocks this budget needs
        self.fp8 = fp8  # frozen block linears in FP8 after the adapters are added (models/fp8.py)
        self.fp8_storage = fp8_storage  # the same, stored only: dequantized at use (models/fp8.py)
        self.blocks_to_swap = blocks_to_swap or 0  # frozen weights of N blocks in host memory (models/blockswap.py)
        self.offload_activations = offload_activations  # checkpointed blocks' inputs in host memory (fast.py)
        # checkpointed blocks keep some outputs (fast.py): True all, False none, None where the memory budget has room
        self.selective_checkpointing = selective_checkpointing
        # share of training samples with zeroed audio (a family with audio input; None: its default_audio_dropout)
        self.audio_dropout = self.default_audio_dropout if audio_dropout is None else audio_dropout
        if audio_dropout and not self.draws_audio_dropout:
            raise ConfigError(f"model.audio_dropout={audio_dropout}: model={name} has no audio input; set it to 0")
        self.animate_mode = animate_mode  # a family with modes reads it (Wan2.2-Animate); others refuse one
        if animate_mode is not None and not self.modes:
            raise ConfigError(f"model.animate_mode={animate_mode}: model={name} has no modes; leave it null")
        diffusers_only = not self.wanexp_forward(True)  # no setting gives this family wanexp's forward
        if fast_modulation and diffusers_only:
            raise ConfigError(f"model.fast_modulation=true: model={name}'s DiT runs diffusers' forward, which has no "
                              "per-frame modulation; set model.fast_modulation=false")
        if diffusers_only:
            needs = f"wanexp's transformer forward, which model={name} does not have (its DiT runs diffusers')"
        else:
            needs = " and ".join(["model.gradient_checkpointing=true"] * (not gradient_checkpointing)
                                 + ["model.fast_modulation=true"] * (not self.wanexp_forward(fast_modulation)))
        if offload_activations and needs:
            raise ConfigError("model.offload_activations=true keeps the checkpointed blocks' inputs in host memory: it "
                              f"needs {needs}")
        if selective_checkpointing and not self.selective_checkpointing_supported:
            raise ConfigError(f"model.selective_checkpointing=true: model={name}'s blocks have no save policy; set it "
                              "to false (every checkpointed block recomputes all but its input)")
        if selective_checkpointing and needs:
            raise ConfigError("model.selective_checkpointing=true chooses what a checkpointed block keeps: it needs "
                              f"{needs}")
        if selective_checkpointing and offload_activations:
            raise ConfigError("model.selective_checkpointing=true keeps outputs on the GPU that "
                              "model.offload_activations=true is there to move off it; set one of them to false")
        # a family without wanexp's forward checkpoints every block (gradient_checkpointing): its budget sizes
        # model.blocks_to_swap=auto and checks the fit (memory_plan), as the hw presets set it
        if memory_budget_gib is not None and needs and not diffusers_only:
            raise ConfigError(f"model.memory_budget_gib={memory_budget_gib:g} picks which blocks to checkpoint: it "
                              f"needs {needs}")
        if attention_backend is not None:
            check_attention_backend(attention_backend)
        if first_frame_cond and not self.draws_first_frame:
            raise ConfigError(f"model.first_frame_cond={first_frame_cond}: model={name} has no optional first-frame "
                              "conditioning (its layout always or never conditions on the first frame); set it to 0")

    # ---- which experts a run trains -------------------------------------------------------------------------
    def trained_experts(self, boundary: str) -> list[str]:
        if self.experts == ["dense"]:
            return ["dense"]
        return {"full": ["high", "low"], "high": ["high"], "low": ["low"]}[boundary]

    # ---- the local folder -----------------------------------------------------------------------------------
    def required_folders(self, experts: list[str]) -> list[str]:
        return list(dict.fromkeys(self.expert_folders[e] for e in experts)) + list(self.encoder_folders)

    def load_bytes(self, experts: list[str], encoders: bool) -> int:
        """Bytes of the weight files one rank reads for these experts (and the encoders' components)."""
        folders = [self.expert_folders[e] for e in experts] + (list(self.encoder_folders) if encoders else [])
        return sum(f.stat().st_size for sub in folders for f in weight_files(self.path / sub))

    def not_diffusers_hint(self, path: Path) -> str | None:
        """A family's one-line advice for a folder without model_index.json (e.g. its original release layout and
        the command that converts it), or None."""
        return None

    def check_folder(self, experts: list[str]) -> None:
        """Raise ConfigError naming the first missing piece of the local diffusers-format folder."""
        p = self.path
        hint = f"point model.path at a local diffusers-format {self.name} folder"
        if not p.is_dir():
            raise ConfigError(missing_model_folder(p, self.name))
        if not (p / "model_index.json").is_file():
            advice = self.not_diffusers_hint(p)
            if advice:
                raise ConfigError(f"model.path={p}: {advice}")
            raise ConfigError(f"model.path={p}: no model_index.json, so this is not a diffusers-format folder; {hint}")
        for sub in self.required_folders(experts):
            marker = "tokenizer_config.json" if sub == "tokenizer" else "config.json"
            if not (p / sub / marker).is_file():
                raise ConfigError(
                    f"model.path={p}: component '{sub}/' is missing or has no {marker} "
                    f"(model={self.name} with experts {experts} needs {', '.join(self.required_folders(experts))})"
                )
        for sub in dict.fromkeys(self.expert_folders[e] for e in experts):
            cfg = json.loads((p / sub / "config.json").read_text())
            if cfg.get("in_channels") != self.in_channels:
                raise ConfigError(
                    f"model.path={p}: {sub} has in_channels={cfg.get('in_channels')} but model={self.name} "
                    f"expects {self.in_channels}; pick the model group that matches this folder"
                )
        self.check_weight_files(experts)

    def check_weight_files(self, experts: list[str]) -> None:
        """Each safetensors file of the components a run loads, by its header alone (no tensor is read): a corrupt
        or truncated file (a partial download) is one line naming it, before anything loads or is written."""
        what = {self.expert_folders[e]: f"the {e} transformer" for e in experts} | {"vae": "the VAE",
                                                                                    "text_encoder": "the text encoder"}
        for sub in self.required_folders(experts):
            for f in weight_files(self.path / sub):
                problem = safetensors_problem(f) if f.suffix == ".safetensors" else None
                if problem:
                    raise unreadable_weights(self.path, what.get(sub, sub), f"{sub}/{f.name}: {problem}")

    def transformer_config(self, expert: str) -> dict:
        """The diffusers config.json of an expert's transformer (read from the folder; nothing loads)."""
        return json.loads((self.path / self.expert_folders[expert] / "config.json").read_text())

    def meta_transformers(self, boundary: str) -> dict:
        """Each trained expert's transformer built on the meta device from its config.json (shapes, no values): what
        the pre-flight checks and counts (the built model, the disk, the memory plan), built once."""
        import warnings

        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")  # no values: shapes
            return {e: self.transformer_type().from_config(self.transformer_config(e)).requires_grad_(False)
                    for e in self.trained_experts(boundary)}

    # ---- loading --------------------------------------------------------------------------------------------
    def transformer_type(self) -> type:
        """The DiT class (its ``from_config`` builds one on the meta device for counts, its ``from_pretrained``
        loads one)."""
        return load_class(self.transformer_class)

    def set_attention_backend(self, model) -> None:
        """``model`` (this family's transformer) on model.attention_backend's kernel (models/attention.py)."""
        set_attention_backend(model, self.attention_backend)

    def load_transformer(self, expert: str):
        """The frozen transformer of ``expert``, ready for the run (attention backend, checkpointing, the family's
        own forward)."""
        model = self.read_transformer(expert)
        model.requires_grad_(False)
        self.set_attention_backend(model)
        if self.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return self.prepare_transformer(model)

    def read_transformer(self, expert: str):
        """The transformer of ``expert`` as stored, its weights in ``model.dtype`` (``from_pretrained``)."""
        return self.transformer_type().from_pretrained(self.path, subfolder=self.expert_folders[expert],
                                                       dtype=self.dtype)

    def prepare_transformer(self, model):
        """A family's own changes to a loaded, frozen transformer (faster forwards, compilation); none here."""
        return model

    def compute_dtype(self, transformer) -> torch.dtype:
        """The dtype of the base weights, which the DiT's inputs are cast to (bf16-true converts the weights); a model
        trained whole has no frozen weight: its first parameter's."""
        frozen = next((p for p in transformer.parameters() if not p.requires_grad), None)
        return (frozen if frozen is not None else next(transformer.parameters())).dtype

    def load_vae(self):
        vae = load_class(self.vae_class).from_pretrained(self.path, subfolder="vae", dtype=self.vae_dtype)
        return vae.requires_grad_(False).eval()

    def load_text_encoder(self):
        te = load_class(self.text_encoder_class).from_pretrained(os.fspath(self.path / "text_encoder"),
                                                                 dtype=self.text_encoder_dtype)
        return te.requires_grad_(False).eval()

    def load_tokenizer(self):
        return load_class(self.tokenizer_class).from_pretrained(os.fspath(self.path / "tokenizer"))

    def encoder_source(self, component: str) -> Path:
        """Where an encoder component (``vae``, ``text_encoder``, ``tokenizer``) loads from: its model.path folder."""
        return self.path / component

    def encoder_info(self) -> EncoderInfo:
        """What identifies this model's encoders for cache keys, and its latent grid (plain data)."""
        return EncoderInfo(vae=str(self.encoder_source("vae")), vae_dtype=str(self.vae_dtype), layout=self.layout,
                           text_encoder=str(self.encoder_source("text_encoder")),
                           text_dtype=str(self.text_encoder_dtype),
                           tokenizer=str(self.encoder_source("tokenizer")), text_len=self.text_len,
                           cond_id=self.needs_image_latent, vae_stride=tuple(self.vae_stride),
                           patch=tuple(self.patch), fps=self.fps, frame_rule=tuple(self.frame_rule),
                           sample_inputs=tuple(self.sample_inputs),
                           load_sample_input=self.load_sample_input if self.sample_inputs else None,
                           media_encoders=tuple(str(self.path / f) for f in self.encoder_folders
                                                if f not in ("vae", "text_encoder", "tokenizer")),
                           input_fallbacks=tuple(self.sample_input_fallbacks.items()),
                           pads_sequence=self.pads_sequence,
                           check_sample_input=self.check_sample_input if self.sample_inputs else None)

    # ---- the tiny random build (model.build) ------------------------------------------------------------------
    def write_random_model(self, folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Write a random model of this layout, sized by ``self.build``, as a complete folder into ``folder``
        (an empty temporary folder: wanexp.models.tiny.ensure_tiny_model renames it into place)."""
        raise NotImplementedError(f"{type(self).__name__} has no tiny random build")

    # ---- the DiT input ----------------------------------------------------------------------------------------
    def sample_condition(self, cond: dict, batch_size: int, generator: torch.Generator | None = None) -> dict:
        """Random per-sample conditioning choices of a training step (none unless the layout has some)."""
        return cond

    def model_inputs(self, x_t, x0, sigma, cond: dict):
        """Return (hidden_states, timestep, loss_mask or None) for the DiT."""
        raise NotImplementedError

    # ---- [seam: adapters] adapter naming and external key maps (wanexp.adapters asks these) ---------------------
    # How the family names the modules adapters train and their names in other trainers' files (a
    # wanexp.adapters.naming.AdapterNaming); None: the family trains no adapter (a run with one is refused in one line).
    adapter_naming = None

    # ---- [seam: conditioning] experts, encoders, per-sample inputs, the transformer call, sequence parallel ------
    # Which diffusers subfolder holds each expert, and the component folders the encoders load (folder checks, bytes
    # read, cache keys).
    expert_folders: dict[str, str] = {"dense": "transformer"}
    encoder_folders: tuple[str, ...] = ("vae", "text_encoder", "tokenizer")
    # Extra metadata columns every sample carries (column -> what it is), each a file path relative to the metadata's
    # folder like ``video``; loaded by load_sample_input into the loader item under the column's name.
    sample_inputs: dict[str, str] = {}
    # Sample inputs a row may leave out: input -> the other columns it is read from, in order; a row with none of
    # them hands the clip's own media path to load_sample_input (e.g. a video's audio stream).
    sample_input_fallbacks: dict[str, tuple[str, ...]] = {}
    # whether wanexp-sample needs every sample input once per --prompt (``--<input>`` flags); False: its sampler has a
    # default for a missing one (e.g. zero features)
    sampling_needs_inputs: bool = False

    def route(self, sigma: torch.Tensor, loaded: list[str]) -> torch.Tensor:
        """Each sample's expert as an index into ``loaded`` (long, on sigma's device): here every sample goes to the
        one loaded expert."""
        return torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)

    def expert_for_step(self, sampler, sigma_range: tuple[float, float], seed: int,
                        step: int) -> tuple[str, tuple[float, float]]:
        """The expert every rank trains at ``step`` when the experts are sharded, and the sigma range its samples are
        drawn from; one expert: it, over the whole range."""
        return self.experts[0], sigma_range

    def load_encoders(self):
        """The family's frozen encoders as one module (a wanexp.models.encoders.Encoders)."""
        raise ConfigError(f"model={self.name}: its family provides no encoders (ModelSpec.load_encoders)")

    def load_sample_input(self, name: str, path: str, num_frames: int, fps: int | None,
                          size: tuple[int, int] | None = None, start: int = 0, stride: int = 1) -> torch.Tensor:
        """One of ``sample_inputs`` of a sample, read from its file for a clip of ``num_frames`` at ``fps`` whose frames
        are ``size`` (height, width) pixels (an input with frames of its own is cropped as the clip is): the clip's
        window, frames ``start, start + stride, ...`` of the clip at ``fps`` (0 and 1 for a sample from a file's
        start: wanexp-sample, validation)."""
        raise ConfigError(f"model={self.name}: its family declares the sample input {name!r} but provides no "
                          "load_sample_input to read it")

    def check_sample_input(self, name: str, path: str) -> str | None:
        """Why a sample's input file cannot be read (a one-line reject reason), or None; run by the data probe
        (``data.probe``) before anything loads. Default: no check beyond the loader's."""
        return None

    def transformer_call(self, transformer, hidden: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                         cond: dict) -> torch.Tensor:
        """The DiT's velocity for its input (inputs already in the compute dtype)."""
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

    def blocks(self, transformer):
        """The DiT's repeated blocks, an nn.ModuleList (block swap, FP8, compilation and FSDP work per block)."""
        return transformer.blocks

    pads_sequence = False  # sequence parallel: True where the family pads its tokens to a multiple of the ranks
    # model.selective_checkpointing: True where the family's checkpointed blocks take a save policy
    selective_checkpointing_supported = False

    @classmethod
    def wanexp_forward(cls, fast_modulation: bool) -> bool:
        """Whether the DiT runs wanexp's own forward (what sequence parallel, offloaded activations and the memory
        budget hook into): for Wan2.2, ``model.fast_modulation``'s forward (models/wan22/fast.py). A family whose DiT
        always runs diffusers' forward returns False for both values: model.fast_modulation=true and offloaded
        activations are then refused, and its memory budget only sizes block swap."""
        return fast_modulation

    def enable_sequence_parallel(self, transformer, sp, gradient_free: bool = False) -> None:
        """Split every training forward's tokens over the ranks of ``sp`` (a wanexp.models.sequence.SequenceGroup);
        ``gradient_free``: every forward without gradients too (generation on several ranks: wanexp-sample --sp)."""
        raise ConfigError(f"parallel.sp_size={sp.size}: model={self.name} has no sequence parallel; set "
                          "parallel.sp_size=1")

    def set_sequence_parallel(self, transformer, active: bool) -> None:
        """Turn the sequence split of an enabled transformer on (training forwards) or off (gradient-free ones)."""
        if active:
            raise ConfigError(f"model={self.name} has no sequence parallel; set parallel.sp_size=1")

    # ---- [seam: shapes, memory, FLOPs] shape rules, the memory and FLOP formulas the planner and perf read ------

    def step_flops(self, config, latent_shape, text_len: int, checkpointing: bool) -> float | None:
        """Model FLOPs of one LoRA training step (forward + backward) over latents of ``latent_shape`` through a
        transformer of this ``config``; None: the family gives no formula (no TFLOP/s is shown)."""
        return None

    def memory_formula(self):
        """What wanexp.memory_plan asks for a transformer config's block count and weight / activation GiB
        (``block_count(config)``, ``weights_gib(config, weight_bytes, other_bytes, resident_blocks)``,
        ``activations_gib(config, tokens, checkpointing, offloading, compiled)``, ``compiled(compile)``); None: the
        family gives no estimate, and nothing is planned automatically."""
        return None

    @classmethod
    def check_groups(cls, data: dict, adapter: dict | None) -> None:
        """The family's own rules on the run's ``data`` and ``adapter`` groups (plain dicts, resolved; adapter None:
        none), run with the config rules before anything loads: a ConfigError line naming the key and the fix.
        Default: none beyond the shared rules (the frame rule, ``model.hw_multiple``)."""

    # ---- [seam: generation, bench, conversion] the sampling pipeline, the plain reference loop, converters -----
    # What `python -m wanexp.cli.convert` can turn into this family's diffusers-format folder: a source layout's name
    # -> ``package.module.function(src, dst, layout, **options) -> lines`` (ModelSpec.convert).
    converters: dict = {}
    # How wanexp-sample --cfg-parallel splits the family's CFG pairs over two processes: "text" (its pipeline calls
    # the transformer twice per step, conditional then unconditional, the calls differing only in
    # encoder_hidden_states: wanexp.parallel.generation.cfg_split splits them from outside), "pairs" (its pipeline
    # runs each pair through wanexp.parallel.generation.cfg_pair itself), None (not supported: refused).
    cfg_parallel: str | None = None

    @classmethod
    def is_release_folder(cls, path: Path) -> bool:
        """Whether ``path`` is this family's release folder in a layout without ``model_index.json`` (wanexp-sample
        --model-path finds the model group by it); diffusers-format folders are found by their transformer."""
        return False

    def load_transformer_sharded(self, expert: str, device, mesh):
        """Transformer ``expert`` sharded over ``mesh`` as it loads, each rank reading only its rows
        (wanexp.models.sharded; wanexp-sample --shard); default: a diffusers-format expert folder."""
        from wanexp.models.sharded import load_sharded

        return load_sharded(self, expert, device, mesh)

    def load_pipeline(self, device, dtype, image: bool):
        """The family's sampling pipeline (``wanexp.models.pipeline.Pipeline``) loaded whole from ``model.path``
        (``wanexp-sample``); ``image``: an image-to-video sample (a first frame given)."""
        raise ConfigError(f"model={self.name}: its family provides no sampling pipeline")

    def make_pipeline(self, transformers: dict, vae, scheduler, image: bool):
        """The family's sampling pipeline around modules already in memory (validation: the run's transformers,
        expert name -> module, and its VAE; prompts come as embeddings), nothing loaded or copied."""
        raise ConfigError(f"model={self.name}: its family provides no sampling pipeline")

    def load_scheduler(self):
        """The sampling scheduler the model folder ships."""
        raise ConfigError(f"model={self.name}: its family provides no sampling scheduler")

    def encode_prompts(self, prompts: list[str], device, encoders=None) -> dict:
        """Each prompt's text embedding (text_len, D) on the CPU: with ``encoders`` (the run's), else with the text
        encoder of ``model.path``, loaded for this call and freed after it."""
        raise ConfigError(f"model={self.name}: its family provides no prompt encoding")

    @classmethod
    def convert(cls, source: str, src, dst, **options) -> list[str]:
        """Write this layout's diffusers-format folder at ``dst`` from ``src`` in the ``source`` layout (one of
        ``converters``); returns one line per written component."""
        if source not in cls.converters:
            have = ", ".join(sorted(cls.converters)) or "none"
            raise ConfigError(f"--from {source}: {cls.__name__} converts from {have}")
        return load_class(cls.converters[source])(src, dst, cls.layout, **options)

    @classmethod
    def plain_loop(cls):
        """The plain reference loop ``wanexp-bench`` times and checks the step against, or None: the family has none.
        A module-like object with ``supports(model)``, ``folder(model)``, ``dense(model)``, ``geometry(model,
        model_path)``, ``step_flops``, ``plain_model``, ``plain_inputs``, ``plain_forward``, ``plain_loss`` and
        ``plain_step`` (Wan2.2's: wanexp/models/wan22/plain_loop.py)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, path={str(self.path)!r})"
