"""Typed schemas of every config group, registered in Hydra's ConfigStore; the YAML files in conf/ extend them.

Types are enforced by OmegaConf while Hydra composes (``optim.lr=abc`` fails there). Allowed values and ranges sit in
each field's metadata (``knob(..., ge=1)``, ``choices=...``) and are checked by :func:`wanexp.config.check_schema`
right after composition, before anything heavy is imported. Every default and every allowed-value list of the run
configuration lives here once; the YAML files only restate what a group changes.

A YAML file picks its schema with a defaults entry, e.g. ``conf/optim/adamw.yaml``::

    defaults:
      - /schema/optim@_here_
      - _self_
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from omegaconf import MISSING

# ---- allowed values (each list exists once; code that consumes them imports them from here) ----------------------
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # config name -> torch dtype name
PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "32", "32-true")  # 16-mixed: pre-Ampere GPUs (V100)
BOUNDARIES = ("full", "high", "low")
EXPERTS = ("dense", "high", "low")
TIMESTEP_SAMPLING = ("uniform", "logit_normal", "mode")  # SD3 / diffusers / musubi-tuner names
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap", "gaussian")  # flow matching; SD3 / diffusers / musubi-tuner
# names, and DiffSynth-Studio's training weight (gaussian)
SCHEDULERS = ("constant", "cosine", "linear")
LR_SCALING = ("none", "linear", "sqrt")
PARALLEL = ("single", "ddp", "fsdp", "deepspeed")
FSDP_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP")
FSDP_PARAM_DTYPES = ("bf16", "fp32")
WANDB_MODES = ("online", "offline", "disabled")
WINDOW_MODES = ("first", "uniform", "chunks", "random")
EMA_VALIDATE = ("raw", "ema", "both")  # callbacks.ema.validate_with


def knob(default: Any = MISSING, *, ge=None, gt=None, le=None, lt=None, choices=None, doc: str = ""):
    """A schema field with its constraints (checked after composition by ``check_schema``)."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, doc=doc).items() if v not in (None, "")}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---- model, boundary -------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    _target_: str = MISSING  # the spec class: a wanexp.models.family.ModelSpec subclass (e.g. a wan22 layout)
    name: str = MISSING
    path: Optional[str] = knob(MISSING, doc="a local diffusers-format folder, or one .safetensors DiT file "
                               "(ComfyUI's repackaged, or any in the original Wan names: the dense or high-noise "
                               "transformer); null: every component from its own path below")
    dtype: str = knob(MISSING, choices=tuple(DTYPES), doc="base weights (LoRA parameters stay fp32)")
    vae_dtype: str = knob(MISSING, choices=tuple(DTYPES))
    text_encoder_dtype: str = knob(MISSING, choices=tuple(DTYPES))
    experts: List[str] = knob(MISSING, choices=EXPERTS)
    boundary_ratio: Optional[float] = knob(MISSING, gt=0.0, lt=1.0, doc="HIGH expert when shifted sigma >= this")
    shift: float = knob(MISSING, gt=0.0)
    hw_multiple: int = knob(MISSING, ge=1, doc="height/width must divide by this")
    frame_rule: List[int] = knob(MISSING, doc="[m, r]: a sample's frame count n keeps n % m == r (the VAE's temporal "
                                              "stride m; Wan2.2: [4, 1])")
    text_len: int = knob(MISSING, ge=1)
    fps: int = knob(MISSING, ge=1, doc="native frame rate: training clips are resampled to it (data.fps: null) and "
                    "generated videos are written at it")
    gradient_checkpointing: bool = MISSING
    attention_backend: Optional[str] = MISSING  # fa4 or a diffusers backend (models/attention.py)
    first_frame_cond: float = knob(MISSING, ge=0.0, le=1.0, doc="share trained image-to-video (optional first frame)")
    build: Optional[Dict[str, Any]] = MISSING  # tiny models only: the architecture to build into `path`
    fast_modulation: bool = knob(MISSING, doc="time embedding + block modulation once per latent frame (same values)")
    compile: bool = knob(MISSING, doc="torch.compile each transformer block (regional compilation)")
    compile_checkpoint: bool = knob(True, doc="with compile: a checkpointed block's recompute inside its compiled graph")
    cuda_graphs: bool = knob(False, doc="with compile: the compiled blocks' forward and backward replayed as CUDA "
                             "graphs (torch.compile's reduce-overhead mode), one recording per bucket shape: less host "
                             "time per step, GPU only")
    memory_budget_gib: Optional[float] = knob(MISSING, gt=0.0, doc="checkpoint only the blocks this GPU budget needs")
    offload_activations: bool = knob(False, doc="the checkpointed blocks' inputs kept in pinned host memory between "
                                     "the forward and the backward (needs gradient_checkpointing)")
    selective_checkpointing: Optional[bool] = knob(None, doc="a checkpointed block keeps its attention output and its "
                                                   "FFN up-projection for the backward and recomputes the rest (more "
                                                   "memory, less recompute; needs gradient_checkpointing): true every "
                                                   "checkpointed block, false none, null the blocks "
                                                   "model.memory_budget_gib has room for")
    fp8: bool = knob(False, doc="frozen block linears in FP8 (per-row scales), LoRA unchanged; changes the numerics")
    fp8_storage: bool = knob(False, doc="frozen block linears stored in FP8 (per-row scales), dequantized at use: "
                             "any GPU; changes the numerics")
    audio_dropout: Optional[float] = knob(None, ge=0.0, le=1.0, doc="share of training samples with zeroed audio "
                                          "features (audio CFG's unconditional branch); null: the family's default "
                                          "(S2V: 0.1, none without audio input)")
    animate_mode: Optional[str] = knob(None, choices=("animation", "replacement"),
                                       doc="Wan2.2-Animate: animation (the reference character driven by the pose and "
                                           "face videos) or replacement (it replaces the person of a background video "
                                           "inside a mask); null: the family's first (Animate: animation), or a model "
                                           "without modes")
    # Any: a block count or "auto" (the config rules check which; OmegaConf has no int-or-string type)
    blocks_to_swap: Any = knob(None, ge=0, doc="frozen weights of N blocks kept in host memory, copied to the GPU "
                               "ahead of use (null/0: none; auto: the fewest that fit)")
    # Components one by one, each a single weight file or the component's folder, over model.path's
    # (docs/data.md, Weights): ComfyUI's repackaged files load directly, fp8 ones dequantized to the dtypes above.
    transformer_path: Optional[str] = knob(None, doc="the DiT: the dense model, or the A14B high-noise expert")
    transformer_2_path: Optional[str] = knob(None, doc="the A14B low-noise expert's DiT")
    vae_path: Optional[str] = knob(None, doc="the VAE (wan2.2_vae.safetensors for TI2V-5B, wan_2.1_vae for A14B)")
    text_encoder_path: Optional[str] = knob(None, doc="the text encoder (e.g. umt5_xxl_fp16, umt5_xxl_fp8_e4m3fn_scaled)")
    tokenizer_path: Optional[str] = knob(None, doc="the text encoder's tokenizer folder (a single encoder file carries none)")


@dataclass
class BoundaryConfig:
    name: str = knob(MISSING, choices=BOUNDARIES)
    sigma_min: float = knob(MISSING, ge=0.0, le=1.0)
    sigma_max: float = knob(MISSING, ge=0.0, le=1.0)


# ---- adapter, objective, optim ---------------------------------------------------------------------------------
@dataclass
class LoraConfig:
    _target_: str = "wanexp.adapters.LoraAdapter"
    name: str = MISSING
    rank: int = knob(MISSING, ge=1)
    alpha: float = knob(MISSING, gt=0.0, doc="scale = alpha / rank")
    dropout: float = knob(MISSING, ge=0.0, lt=1.0)
    targets: List[str] = knob(MISSING)  # names checked by the adapter
    attention: Optional[List[str]] = knob(MISSING)
    init_from: Optional[str] = MISSING  # a LoRA file (ComfyUI or diffusers format) to start from
    use_dora: bool = knob(MISSING, doc="DoRA: a trained magnitude per output row besides the LoRA (adapter=lora only)")
    family: str = "${model._target_}"  # the model's spec class: its adapter_naming names the modules adapters train


@dataclass
class LokrConfig(LoraConfig):
    """``adapter=lokr``: peft's LoKr with the LoRA group's keys (dropout is its rank dropout)."""

    _target_: str = "wanexp.adapters.LokrAdapter"


@dataclass
class LohaConfig(LoraConfig):
    """``adapter=loha``: peft's LoHa with the LoRA group's keys (dropout is its rank dropout)."""

    _target_: str = "wanexp.adapters.LohaAdapter"


@dataclass
class TimestepConfig:
    sampling: str = knob(MISSING, choices=TIMESTEP_SAMPLING)
    shift: float = knob(MISSING, gt=0.0)
    logit_mean: float = MISSING
    logit_std: float = knob(MISSING, gt=0.0)
    mode_scale: float = knob(1.29, ge=-1.0, le=1.75, doc="sampling=mode: its scale s (SD3; > 0 favours mid noise; "
                             "monotone up to 2/(pi-2) = 1.75)")


@dataclass
class ObjectiveConfig:
    """What every objective has; an objective's own schema extends it."""

    _target_: str = MISSING
    name: str = MISSING


@dataclass
class FlowMatchingConfig(ObjectiveConfig):
    _target_: str = "wanexp.objectives.flow_matching.FlowMatching"
    name: str = "flow_matching"
    timestep: TimestepConfig = MISSING
    weighting: str = knob(MISSING, choices=LOSS_WEIGHTINGS, doc="per-sample loss weight w(sigma)")


@dataclass
class AdapterOptimConfig:
    """One adapter's optimizer in a several-adapter objective (overrides of optim.optimizer, plus clipping)."""

    lr: float = knob(MISSING, gt=0.0, le=1.0)
    weight_decay: float = knob(MISSING, ge=0.0)
    eps: float = knob(MISSING, gt=0.0)
    betas: List[float] = knob(MISSING)
    clip: Optional[float] = knob(MISSING, gt=0.0, doc="max gradient norm (null: no clipping)")


@dataclass
class DMDConfig(ObjectiveConfig):
    _target_: str = "wanexp.objectives.dmd.DMD"
    name: str = "dmd"
    timestep: TimestepConfig = MISSING  # the noise levels the critic trains on and the teacher scores at
    student_timesteps: List[int] = knob(MISSING, doc="the student's sampling steps, before the shift (t in 1..1000)")
    student_shift: float = knob(MISSING, gt=0.0)
    guidance_scale: float = knob(MISSING, ge=1.0, doc="teacher CFG: v_u + w (v_c - v_u); 1 = no guidance")
    negative_prompt: str = MISSING
    generator_every: int = knob(MISSING, ge=1, doc="a generator update after every N critic updates")
    generator: AdapterOptimConfig = MISSING
    critic: AdapterOptimConfig = MISSING
    # DMD2 / VideoX-Fun options (conf/objective/dmd.yaml sets the recipe's values)
    fake_guidance_scale: float = knob(MISSING, ge=0.0, doc="critic CFG in the teacher's form; 1 = conditional only")
    score_sigma_clamp: Optional[List[float]] = knob(MISSING, doc="[lo, hi] for scoring and critic sigmas; null: none")
    critic_outlier: Optional[float] = knob(MISSING, gt=0.0, doc="critic loss drops elements with |error| > this")
    first_frame_cond: Optional[float] = knob(MISSING, ge=0.0, le=1.0, doc="TI2V: share on frame 0; null: 0.5")


@dataclass
class KDConfig(ObjectiveConfig):
    _target_: str = "wanexp.objectives.kd.KnowledgeDistillation"
    name: str = "kd"
    timestep: TimestepConfig = MISSING  # the noise levels the student learns the teacher's velocity at
    student: Dict[str, Any] = knob(MISSING, doc="the teacher transformer's config overrides (num_layers null: half)")
    feature_weight: float = knob(MISSING, ge=0.0, doc="weight of the block-output MSE (student block vs its teacher block)")


@dataclass
class OptimizerConfig:
    """What every ``optim.optimizer`` node has: the class, called with the parameters and the (scaled) learning rate
    (``_partial_``). Each optimizer's schema extends it; its class attributes (not config keys) say what the config
    rules hold it to (wanexp.config.rules.check_optim)."""

    _target_: str = MISSING
    _partial_: bool = MISSING  # the module calls it with the parameters and the (scaled) learning rate
    option: ClassVar[str] = ""  # the optim group's option (conf/optim/<option>.yaml)
    package: ClassVar[Optional[Tuple[str, str]]] = None  # (module, the pip pin that installs it); None: torch's
    lr_is_multiplier: ClassVar[bool] = False  # lr scales the optimizer's own step-size estimate (no lr_scaling)
    adapter_overrides: ClassVar[bool] = True  # takes Adam's betas (2), eps, weight_decay (objective=dmd sets them)
    unsharded_only: ClassVar[str] = ""  # why it cannot run on FSDP/DeepSpeed-sharded parameters; "": it can
    cpu_from: ClassVar[Optional[str]] = None  # the package version whose kernels run on the CPU; None: any


@dataclass
class AdamWConfig(OptimizerConfig):
    option: ClassVar[str] = "adamw"
    betas: List[float] = knob(MISSING)
    eps: float = knob(MISSING, gt=0.0)
    weight_decay: float = knob(MISSING, ge=0.0)
    fused: Optional[bool] = MISSING  # null: fused kernel where every parameter is on a GPU


@dataclass
class AdamW8bitConfig(OptimizerConfig):
    """bitsandbytes' AdamW with 8-bit blockwise-quantized moments (about a quarter of AdamW's optimizer memory)."""

    option: ClassVar[str] = "adamw8bit"
    package: ClassVar[Optional[Tuple[str, str]]] = ("bitsandbytes", "bitsandbytes==0.50.2")
    unsharded_only: ClassVar[str] = "bitsandbytes' 8-bit kernels take whole plain tensors, not sharded parameters"
    cpu_from: ClassVar[Optional[str]] = "0.50.0"  # its CPU optimizer kernels (earlier builds: CUDA and XPU only)
    betas: List[float] = knob(MISSING)
    eps: float = knob(MISSING, gt=0.0)
    weight_decay: float = knob(MISSING, ge=0.0)
    min_8bit_size: int = knob(MISSING, ge=1, doc="tensors with fewer elements keep 32-bit moments")


@dataclass
class ProdigyConfig(OptimizerConfig):
    """Prodigy: Adam whose step size d is estimated from the gradients; ``optim.lr`` multiplies it."""

    option: ClassVar[str] = "prodigy"
    package: ClassVar[Optional[Tuple[str, str]]] = ("prodigyopt", "prodigyopt==1.1.2")
    lr_is_multiplier: ClassVar[bool] = True
    unsharded_only: ClassVar[str] = "its step-size estimate sums over whole parameters, which sharding splits " \
                                    "across ranks"
    betas: List[float] = knob(MISSING)
    beta3: Optional[float] = knob(MISSING, gt=0.0, lt=1.0, doc="the d estimate's running averages; null: sqrt(beta2)")
    eps: float = knob(MISSING, gt=0.0)
    weight_decay: float = knob(MISSING, ge=0.0)
    decouple: bool = knob(MISSING, doc="AdamW-style decoupled weight decay")
    use_bias_correction: bool = knob(MISSING, doc="Adam's bias correction (recommended for diffusion)")
    safeguard_warmup: bool = knob(MISSING, doc="lr left out of the d estimate's denominator (needed with warm-up)")
    d0: float = knob(MISSING, gt=0.0, doc="initial step-size estimate")
    d_coef: float = knob(MISSING, gt=0.0, doc="scales the step-size estimate: the knob to tune (0.5 smaller, 2 larger)")
    growth_rate: float = knob(MISSING, gt=1.0, doc="largest growth of d per step (inf: unbounded)")
    slice_p: int = knob(MISSING, ge=1, doc="estimate d from every p-th element (11: less memory, approximate)")


@dataclass
class CAMEConfig(OptimizerConfig):
    """CAME: confidence-guided Adafactor-style factored moments (about Adafactor's memory, Adam-like updates)."""

    option: ClassVar[str] = "came"
    package: ClassVar[Optional[Tuple[str, str]]] = ("came_pytorch", "came-pytorch==0.1.3")
    adapter_overrides: ClassVar[bool] = False
    unsharded_only: ClassVar[str] = "its factored moments need each weight's whole rows and columns"
    betas: List[float] = knob(MISSING, doc="three: first moment, second moment, confidence")
    eps: List[float] = knob(MISSING, doc="two: the squared-gradient and the instability regularizers")
    clip_threshold: float = knob(MISSING, gt=0.0, doc="update RMS clipping")
    weight_decay: float = knob(MISSING, ge=0.0)


@dataclass
class AdafactorConfig(OptimizerConfig):
    """transformers' Adafactor with an external learning rate (``relative_step: false``): factored second moments."""

    option: ClassVar[str] = "adafactor"
    adapter_overrides: ClassVar[bool] = False
    unsharded_only: ClassVar[str] = "its factored moments need each weight's whole rows and columns"
    eps: List[float] = knob(MISSING, doc="two: the squared-gradient and the parameter-scale regularizers")
    clip_threshold: float = knob(MISSING, gt=0.0, doc="update RMS clipping")
    decay_rate: float = knob(MISSING, lt=0.0, doc="second-moment decay exponent")
    beta1: Optional[float] = knob(MISSING, ge=0.0, lt=1.0, doc="first moment; null: none (less memory)")
    weight_decay: float = knob(MISSING, ge=0.0)
    scale_parameter: bool = knob(MISSING, doc="lr scaled by each parameter's RMS")
    relative_step: bool = knob(MISSING, doc="false: optim.lr and the schedule set the step (true is refused)")
    warmup_init: bool = knob(MISSING, doc="relative_step's own warm-up (needs relative_step)")


@dataclass
class OptimConfig:
    """The ``optim`` group: the learning rate, its scaling and schedule (the same for every optimizer), and the
    optimizer (``conf/optim/<name>.yaml`` sets ``lr`` and ``optimizer``)."""

    lr: float = knob(MISSING, gt=0.0, le=1.0, doc="learning rate at reference_batch")
    lr_scaling: str = knob("none", choices=LR_SCALING, doc="scale lr with effective batch / reference_batch: none, "
                           "linear (x ratio) or sqrt (x its square root)")
    reference_batch: int = knob(1, ge=1, doc="the effective batch (per-device batch x devices x accumulation) that lr "
                                "was tuned for")
    scheduler: str = knob("constant", choices=SCHEDULERS, doc="after warm-up")
    warmup_steps: int = knob(0, ge=0)
    min_lr_ratio: float = knob(0.0, ge=0.0, le=1.0, doc="cosine/linear floor as a fraction of lr")
    optimizer: OptimizerConfig = MISSING  # the optimizer's own schema (its YAML's defaults entry)


# ---- data ------------------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    _target_: str = "wanexp.data.datamodule.MediaDataModule"
    name: str = MISSING
    metadata: str = MISSING
    root: Optional[str] = MISSING  # media paths resolve against this folder; null = the metadata file's folder
    num_frames: int = knob(MISSING, ge=1, doc="kept to model.frame_rule")
    height: int = knob(MISSING, ge=1)
    width: int = knob(MISSING, ge=1)
    fps: Optional[int] = knob(MISSING, ge=1, doc="frame rate clips are resampled to (nearest frame); null: model.fps")
    frame_stride: int = knob(MISSING, ge=1, doc="every n-th frame of the clip at data.fps")
    window: str = knob(MISSING, choices=WINDOW_MODES, doc="which frames of a longer clip train")
    windows_per_clip: int = knob(MISSING, ge=0, doc="uniform/chunks: windows per clip (chunks: 0 = all that fit)")
    batch_size: int = knob(MISSING, ge=1, doc="per device")
    token_budget: Optional[int] = knob(MISSING, ge=1, doc="DiT tokens per device batch; sets each bucket's batch")
    num_workers: int = knob(MISSING, ge=0)
    max_samples: Optional[int] = knob(MISSING, ge=1)
    val_fraction: float = knob(MISSING, ge=0.0, lt=1.0, doc="share of the media files held out for the validation loss")
    dataset_repeat: int = knob(MISSING, ge=1, doc="each sample this many times per epoch")
    caption_dropout: float = knob(MISSING, ge=0.0, le=1.0, doc="share of samples trained with the empty prompt")
    caption_extension: str = MISSING  # a folder's caption files: clip.mp4 + clip.txt (or .caption, ...)
    datasets: Optional[Any] = MISSING  # several datasets (a list, or name -> dataset); null: metadata etc. above
    buckets: Optional[List[List[int]]] = MISSING  # [[height, width], ...]: aspect-ratio buckets; null: height x width
    probe: bool = MISSING  # check every media file before training (rejects unusable ones)
    max_reject_fraction: float = knob(MISSING, ge=0.0, le=1.0, doc="stop when more of the rows are rejected")
    rejects: Optional[str] = MISSING  # where rejected rows are listed with their reason (JSON lines)
    cache_dir: Optional[str] = MISSING  # the latent/text cache (python -m wanexp.cli.cache fills it)
    use_cache: bool = MISSING  # train from the cache when it holds every sample of the run; else encode online
    cache_shard_size: int = knob(MISSING, ge=1, doc="entries per cache shard file")
    cache_dtype: str = knob(MISSING, choices=("fp32", "bf16"), doc="dtype of cached latents")
    generate: Optional[Dict[str, Any]] = MISSING  # synthetic data only


# ---- parallel: a name for the cross-group rules + the Lightning strategy by _target_ ---------------------------
@dataclass
class DDPConfig:
    _target_: str = "wanexp.parallel.ddp"
    find_unused_parameters: bool = MISSING
    static_graph: bool = MISSING
    gradient_as_bucket_view: bool = MISSING
    timeout_s: int = knob(MISSING, ge=1)


@dataclass
class FSDPConfig:
    _target_: str = "wanexp.parallel.fsdp.BlockFSDPStrategy"
    sharding_strategy: str = knob(MISSING, choices=FSDP_SHARDING)
    cpu_offload: bool = MISSING
    param_dtype: str = knob(MISSING, choices=FSDP_PARAM_DTYPES)
    timeout_s: int = knob(MISSING, ge=1)


@dataclass
class DeepSpeedConfig:
    _target_: str = "wanexp.parallel.deepspeed"
    stage: int = knob(MISSING, choices=(1, 2, 3), doc="ZeRO stage")
    offload_optimizer: bool = MISSING  # optimizer state in CPU memory (the torch AdamW steps there)
    offload_parameters: bool = MISSING  # stage 3 only: the weights in CPU memory
    timeout_s: int = knob(MISSING, ge=1)


@dataclass
class ParallelConfig:
    name: str = knob(MISSING, choices=PARALLEL)
    strategy: Any = MISSING  # "auto" or a node with _target_ (a Lightning Strategy)
    sp_size: int = knob(1, ge=1, doc="sequence parallel: ranks that split each sample's tokens (Ulysses; ddp|fsdp)")
    concurrent_loads: Optional[int] = knob(None, ge=1, doc="ranks per node that read the base weights into host "
                                           "memory at once (null: as many as the free host memory allows)")
    # Environment set before any CUDA or NCCL use, in every process (a variable already set in the shell wins):
    # the allocator setting by default; on PCIe-only nodes e.g. NCCL_P2P_DISABLE / NCCL_IB_DISABLE (README).
    env: Dict[str, str] = field(default_factory=lambda: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


# ---- trainer: lightning.Trainer arguments ----------------------------------------------------------------------
@dataclass
class TrainerConfig:
    accelerator: str = MISSING
    devices: Any = MISSING
    num_nodes: int = knob(MISSING, ge=1)
    precision: str = knob(MISSING, choices=PRECISIONS)
    max_steps: int = knob(MISSING, ge=-1, doc="-1: run max_epochs")
    max_epochs: Optional[int] = knob(MISSING, ge=1)
    accumulate_grad_batches: int = knob(MISSING, ge=1)
    gradient_clip_val: Optional[float] = knob(MISSING, ge=0.0)
    log_every_n_steps: int = knob(MISSING, ge=1)
    limit_val_batches: Any = MISSING
    num_sanity_val_steps: int = knob(MISSING, ge=-1)
    deterministic: bool = MISSING
    benchmark: Optional[bool] = MISSING
    detect_anomaly: bool = False
    profiler: Optional[str] = None


# ---- loggers and callbacks: named nodes instantiated by _target_ -----------------------------------------------
@dataclass
class CSVLoggerConfig:
    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: str = MISSING
    name: str = "logs"
    version: Optional[str] = None  # null: next free version_N (a resumed session never overwrites earlier metrics)


@dataclass
class WandbLoggerConfig:
    _target_: str = "wanexp.callbacks.wandb_logger.RunWandbLogger"
    project: Optional[str] = MISSING  # null: WANDB_PROJECT, else wanexp
    entity: Optional[str] = MISSING  # null: WANDB_ENTITY
    group: Optional[str] = MISSING  # null: WANDB_RUN_GROUP
    name: Optional[str] = MISSING  # null: WANDB_NAME
    save_dir: str = MISSING
    mode: Optional[str] = knob(MISSING, choices=WANDB_MODES, doc="null: WANDB_MODE from the environment, else online")
    log_lora: bool = knob(MISSING, doc="each LoRA export as a W&B artifact version (type lora)")
    tags: List[str] = knob(MISSING)  # empty: WANDB_TAGS
    resume_from: Optional[str] = MISSING  # the run's resume setting: a resumed run continues its W&B run


@dataclass
class CheckpointConfig:
    _target_: str = "wanexp.callbacks.checkpoint.RunCheckpoint"
    dirpath: str = MISSING
    filename: str = "step_{step:06d}"
    every_n_train_steps: int = knob(MISSING, ge=1, doc="full checkpoint (+ LoRA export) every N optimizer steps")
    save_top_k: int = knob(MISSING, ge=-1, doc="newest N step checkpoints kept (plus last.ckpt); -1 keeps all")
    monitor: str = "step"
    mode: str = "max"
    auto_insert_metric_name: bool = False
    save_last: Any = "link"  # last.ckpt: a link to the newest checkpoint
    save_on_train_epoch_end: bool = False
    # a name is never versioned (-v1): a resume after a kill rewrites last.ckpt's link and the same step names
    enable_version_counter: bool = False


@dataclass
class LoraExportConfig:
    _target_: str = "wanexp.callbacks.lora_export.LoraExport"
    output_dir: str = MISSING
    flag_above: float = knob(MISSING, gt=0.0, doc="|LoRA weight| above which an export is flagged as diverged")
    keep_last: int = knob(MISSING, ge=-1, doc="newest N step exports kept (>= 1; -1 keeps all), plus final")
    keep_every: Optional[int] = knob(MISSING, ge=0, doc="exports at multiples of N steps are never pruned; null: none")


@dataclass
class RunStatusConfig:
    _target_: str = "wanexp.callbacks.status_file.RunStatus"
    output_dir: str = MISSING
    run_name: str = MISSING
    every_s: float = knob(MISSING, gt=0.0, doc="status.json is rewritten at most this often (seconds)")
    peak_tflops: Optional[float] = knob(MISSING, gt=0.0, doc="accelerator peak for perf/pct_of_peak; null: none")


@dataclass
class PreemptionConfig:
    _target_: str = "wanexp.callbacks.preemption.Preemption"
    requeue: bool = MISSING  # under SLURM, SIGUSR1 also requeues the job (scontrol requeue) after the save


@dataclass
class ProgressConfig:
    _target_: str = "wanexp.callbacks.progress.StepProgressBar"


@dataclass
class ProfileConfig:
    _target_: str = "wanexp.callbacks.profile.StepProfile"
    output_dir: str = MISSING
    start_step: int = knob(MISSING, ge=0, doc="profile the optimizer steps after this one")
    steps: int = knob(MISSING, ge=0, doc="how many optimizer steps to profile; 0: off")
    trace: bool = knob(MISSING, doc="also write a Chrome/Perfetto trace per rank (tens of MB for a real model)")


@dataclass
class ValidationConfig:
    _target_: str = "wanexp.callbacks.validation.Validation"
    output_dir: str = MISSING
    every_n_steps: int = knob(MISSING, ge=0, doc="validate every N optimizer steps and at the end; 0: never")
    prompts: List[str] = knob(MISSING)  # sampled with every seed; empty: no videos
    seeds: List[int] = knob(MISSING)
    first_frame: bool = knob(MISSING, doc="TI2V: sample image-to-video from held-out clips' first frames (I2V always)")
    images: Optional[List[str]] = knob(MISSING, doc="image-to-video from these images, one per prompt; null: clips")
    shapes: Any = knob(MISSING, doc="null: the first bucket; buckets: every bucket; or [[h, w], [h, w, frames], ...]")
    fps: int = knob(MISSING, ge=1)
    steps: int = knob(MISSING, ge=1, doc="sampling steps of the base model and of a LoRA that is not distilled")
    guidance: float = knob(MISSING, ge=1.0, doc="CFG of the base model and of a LoRA that is not distilled")
    negative_prompt: str = MISSING
    loss_sigmas: List[float] = knob(MISSING)  # the held-out loss's noise levels (shifted sigma in [0, 1])
    loss_samples: int = knob(MISSING, ge=0, doc="held-out samples the validation loss averages (the first N)")
    timeout_s: int = knob(MISSING, ge=1, doc="how long the other ranks wait while rank 0 samples")
    at_start: bool = knob(MISSING, doc="validate at step 0 of a fresh run (base-model videos: minutes on A14B)")


@dataclass
class EMAConfig:
    _target_: str = "wanexp.callbacks.ema.AdapterEMA"
    decay: Optional[float] = knob(MISSING, ge=0.0, lt=1.0, doc="each update moves the shadow by (1 - decay) toward "
                                  "the weights; null: no EMA")
    every_n_steps: int = knob(MISSING, ge=1, doc="update after every N optimizer steps")
    warmup: bool = knob(MISSING, doc="decay min(decay, (1 + n) / (10 + n)) at the n-th update: a short run's EMA is "
                        "not held at the start weights")
    validate_with: str = knob(MISSING, choices=EMA_VALIDATE, doc="the weights validation samples and scores")


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    data_dir: str = MISSING
    output_dir: str = MISSING
    cache_dir: str = MISSING
    tiny_model_dir: str = MISSING


# ---- the whole run ---------------------------------------------------------------------------------------------
@dataclass
class GuardConfig:
    max_bad_steps: int = knob(MISSING, ge=1, doc="non-finite steps in a row that stop the run")
    lock_stale_s: float = knob(MISSING, gt=0.0, doc="seconds without a heartbeat after which a run lock is stale")


@dataclass
class TrainConfig:
    run_name: str = MISSING
    seed: int = knob(MISSING, ge=0)
    tags: List[str] = knob(MISSING)
    resume: Optional[str] = MISSING  # null | "last" | "auto" | a path to a .ckpt file
    overwrite: bool = MISSING
    allow_resume_changes: bool = MISSING
    guard: GuardConfig = field(default_factory=GuardConfig)
    model: Any = MISSING
    boundary: Any = MISSING
    adapter: Any = MISSING
    objective: Any = MISSING
    optim: Any = MISSING
    data: Any = MISSING
    parallel: Any = MISSING
    trainer: Any = MISSING
    logger: Dict[str, Any] = knob({})  # name -> logger node with _target_
    callbacks: Dict[str, Any] = knob({})  # name -> callback node with _target_ (null disables one)
    paths: Any = MISSING
    sweep: Dict[str, Any] = knob({})  # a sweep config sets sweep.name


SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "boundary": BoundaryConfig,
    "adapter/lora": LoraConfig,
    "adapter/lokr": LokrConfig,
    "adapter/loha": LohaConfig,
    "objective/base": ObjectiveConfig,
    "objective/flow_matching": FlowMatchingConfig,
    "objective/dmd": DMDConfig,
    "objective/kd": KDConfig,
    "optim": OptimConfig,
    "optimizer/adamw": AdamWConfig,
    "optimizer/adamw8bit": AdamW8bitConfig,
    "optimizer/prodigy": ProdigyConfig,
    "optimizer/came": CAMEConfig,
    "optimizer/adafactor": AdafactorConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "strategy/ddp": DDPConfig,
    "strategy/fsdp": FSDPConfig,
    "strategy/deepspeed": DeepSpeedConfig,
    "trainer": TrainerConfig,
    "logger/csv": CSVLoggerConfig,
    "logger/wandb": WandbLoggerConfig,
    "callbacks/checkpoint": CheckpointConfig,
    "callbacks/lora_export": LoraExportConfig,
    "callbacks/status": RunStatusConfig,
    "callbacks/progress": ProgressConfig,
    "callbacks/preemption": PreemptionConfig,
    "callbacks/validation": ValidationConfig,
    "callbacks/profile": ProfileConfig,
    "callbacks/ema": EMAConfig,
    "paths": PathsConfig,
}


def register() -> None:
    """Store every schema as ``schema/<name>`` (and the whole run as ``schema_train``). Idempotent."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema_train", node=TrainConfig)
    for name, node in SCHEMAS.items():
        group, _, leaf = f"schema/{name}".rpartition("/")
        cs.store(group=group, name=leaf, node=node)


# ---- checks ----------------------------------------------------------------------------------------------------
_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _violation(key: str, value: Any, meta: dict) -> str | None:
    """The one-line problem of ``key=value`` under a field's constraints, or None."""
    if "choices" in meta:
        allowed = ", ".join(str(c) for c in meta["choices"])
        if isinstance(value, (list, tuple)):
            bad = [v for v in value if v not in meta["choices"]]
            if bad:
                return f"{key}: unknown value {bad[0]!r} in {list(value)}; allowed values are {allowed}"
        elif value not in meta["choices"]:
            return f"{key}={value}: allowed values are {allowed}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if any(not test(value, meta[k]) for k, (test, _) in _BOUNDS.items() if k in meta):
        bounds = " and ".join(f"{sym} {meta[k]}" for k, (_, sym) in _BOUNDS.items() if k in meta)
        doc = f" ({meta['doc']})" if meta.get("doc") else ""
        return f"{key}={value}: must be {bounds}{doc}"
    return None


def check_schema(cfg, prefix: str = "") -> None:
    """Check every schema-typed node of a composed config against its fields' constraints (ranges, choices).

    Walks the whole tree, so a schema added to ``SCHEMAS`` is checked without further code. ``prefix``: the key of
    ``cfg`` when it is one node of the run (e.g. ``objective.``). Raises ConfigError.
    """
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    from wanexp.errors import ConfigError

    def walk(node, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        fields = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        for key in node.keys():
            full = f"{prefix}{key}"
            if OmegaConf.is_missing(node, key):
                continue
            value = node[key]
            if isinstance(value, DictConfig):
                walk(value, f"{full}.")
                continue
            meta = fields[key].metadata if key in fields else {}
            if value is not None and meta:
                container = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
                problem = _violation(full, container, meta)
                if problem:
                    raise ConfigError(problem)

    walk(cfg, prefix)


def typed_node(node, schema: type, key: str):
    """``node`` (a group that no ConfigStore entry typed at composition) as an instance of the dataclass ``schema``:
    its values (interpolations resolved) over the schema's defaults, then its ranges and choices checked. A value of
    the wrong type, a key the schema lacks, a field left unset or a constraint broken is one ConfigError line."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from wanexp.errors import ConfigError

    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node, resolve=True))
    except ConfigKeyError as e:
        raise ConfigError(f"{key}.{e.full_key}: no such key in {schema.__name__} (the schema of {key}); check the "
                          f"spelling, or add the field to {schema.__name__}") from None
    except OmegaConfBaseException as e:  # a value of the wrong type
        from wanexp.config.messages import one_line_error

        line = one_line_error(e)
        if not line.startswith(str(e.full_key)):  # not a conversion OmegaConf words itself
            line = f"{e.full_key}: {str(e.msg).strip().splitlines()[0]} (in {schema.__name__})"
        raise ConfigError(f"{key}.{line}") from None
    unset = sorted(OmegaConf.missing_keys(typed))
    if unset:  # a field without a default that the YAML leaves out
        raise ConfigError(f"{key}.{unset[0]} is not set and {schema.__name__} has no default for it; set it in the "
                          f"{key} YAML or with {key}.{unset[0]}=...")
    check_schema(typed, f"{key}.")
    return typed
