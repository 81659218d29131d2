"""Wan2.2-VACE-Fun-A14B: Wan2.2's T2V-A14B experts with a VACE control branch (``model=vace14b``, ``tiny_vace``).

Each expert is diffusers' ``WanVACETransformer3DModel``: the 40 T2V blocks plus 8 ``vace_blocks`` that read the
control tokens and add a hint to the hidden states after blocks 0, 5, ..., 35. The control input is 96 channels on
the latent grid (diffusers' ``WanVACEPipeline``, DiffSynth-Studio's VACE unit): the normalised VAE latents of the
kept part of the control video (``video * (1 - mask)``, 16) and of the part to regenerate (``video * mask``, 16),
and the pixel mask folded 8x8 spatially into 64 channels and taken at every 4th frame (nearest) onto the latent
frames. A reference image adds one latent frame before all others: its latent and zeros in the control, zeros in
the mask, and the same latent as the first frame of the latents the DiT denoises (the loss covers it, as
DiffSynth-Studio trains it).

Samples carry three metadata columns (``ModelSpec.sample_inputs``): ``control_video`` (required: depth, pose, canny,
any video), ``control_mask`` (optional image or video, white = generate, black = keep; default: all white) and
``reference_image`` (optional image). All are read at the clip's size; the control video and its mask from their
own first frame at the clip's frame rate.

Adapters train the base blocks (``adapter.targets`` q,k,v,o,ffn.0,ffn.2) and/or the control blocks (the same
names prefixed ``vace.``: DiffSynth-Studio's ``--lora_base_model vace``); ComfyUI names them
``diffusion_model.blocks.N...`` and ``diffusion_model.vace_blocks.N...`` (docs/vace.md).
"""
from __future__ import annotations

import re

import torch

from wanexp.adapters.naming import AdapterNaming
from wanexp.errors import ConfigError
from wanexp.models.wan22.adapter_naming import WAN_NAMING
from wanexp.models.wan22.encoders import WanEncoders, encode_video
from wanexp.models.wan22.memory import WanMemory
from wanexp.models.wan22.pipeline import WanPipelineRunner
from wanexp.models.wan22.spec import T2VA14BSpec

CONTROL_VIDEO, CONTROL_MASK, REFERENCE_IMAGE = "control_video", "control_mask", "reference_image"
CONTROL = "vace_context"  # the encoders' cond key: the 96 control channels
CONTROL_BLOCKS = "vace_blocks"  # the DiT's control blocks (diffusers' and the original release's name)
CONTROL_PREFIX = "vace."  # adapter.targets of the control blocks: vace.q ... vace.ffn.2
# A loaded reference_image is (4, H, W): its 3 channels in [-1, 1] and a 4th that is 1 where the row named an image,
# 0 where it did not (one shape for every row, so rows with and without one share a batch's collate).
GIVEN = 3


# ---- adapter naming: the base blocks and the control blocks -----------------------------------------------------
class VaceNaming(AdapterNaming):
    """Wan's naming for the base ``blocks`` and the same names under ``vace_blocks`` (targets ``vace.<alias>``)."""

    def __init__(self, base: AdapterNaming, control_blocks: str = CONTROL_BLOCKS, prefix: str = CONTROL_PREFIX):
        tables = dict(attention=base.attention, projections=base.projections, feedforward=base.feedforward,
                      original_attention=base.original_attention)
        formats = (f"ComfyUI/original Wan (diffusion_model.blocks.N.self_attn.q and diffusion_model."
                   f"{control_blocks}.N.self_attn.q, lora_down/lora_up or lora_A/lora_B, optional .alpha), "
                   f"kohya/musubi-tuner (lora_unet_blocks_N_..., lora_unet_{control_blocks}_N_...), diffusers/peft "
                   f"(transformer.blocks.N.attn1.to_q.lora_A/lora_B, transformer.{control_blocks}.N...)")
        super().__init__(blocks=base.blocks, formats=formats, convert_lora=None, **tables)
        self.base = AdapterNaming(blocks=base.blocks, formats=formats, **tables)
        self.control = AdapterNaming(blocks=control_blocks, formats=formats, **tables)
        self.prefix = prefix
        self.allowed = self.base.allowed + [prefix + t for t in self.base.allowed]
        self.module_re = re.compile(f"(?:{self.base.module_re.pattern})|(?:{self.control.module_re.pattern})")
        self.probe_modules = self.base.probe_modules + self.control.probe_modules

    def _split(self, targets: list[str]) -> tuple[list[str], list[str]]:
        """(base targets, control targets without the prefix); an unknown name is one line listing every target."""
        base, control = [], []
        for t in targets:
            plain = t.removeprefix(self.prefix)
            known = self.base.aliases.get(plain, plain)
            if known not in self.base.allowed:
                raise ConfigError(f"adapter.targets: unknown target {t!r}; allowed: {', '.join(self.allowed)} (the "
                                  f"{self.prefix}* ones train the control blocks, {self.control.blocks})")
            (control if t.startswith(self.prefix) else base).append(plain)
        return base, control

    def target_regex(self, targets, attention):
        base, control = self._split(targets)
        alts = [n.target_regex(t, attention)[2:-2] for n, t in ((self.base, base), (self.control, control)) if t]
        if not alts:
            raise ConfigError("adapter: targets and attention select no module; e.g. "
                              f"targets=[{','.join(self.allowed)}]")
        return "^(" + "|".join(alts) + ")$"

    def kind(self, module):
        if module.startswith(f"{self.control.blocks}."):
            k = self.control.kind(module)
            return None if k is None else self.prefix + k
        return self.base.kind(module)

    def setting_for(self, kinds):
        order = [self.kind(m) for m in self.probe_modules]
        targets = []
        for t in self.allowed:
            plain, control = t.removeprefix(self.prefix), t.startswith(self.prefix)
            own = [k.removeprefix(self.prefix) for k in kinds if k.startswith(self.prefix) == control]
            if any(k.split(".", 1)[-1] == plain or k == plain for k in own):
                targets.append(t)
        attention = [a for a, orig in self.original_attention.items()
                     if any(k.removeprefix(self.prefix).startswith(f"{orig}.") for k in kinds)]
        setting = f"adapter.targets=[{','.join(targets)}] adapter.attention=[{','.join(attention)}]"
        if [k for k in order if k in kinds] == self.configured_kinds(targets, attention):
            return f"set {setting}"
        return f"no adapter.targets/attention selects exactly these (the closest: {setting})"

    def _of(self, name: str) -> AdapterNaming:
        return self.control if name.startswith(f"{self.control.blocks}.") else self.base

    def to_original(self, module):
        return self._of(module).to_original(module)

    def from_original(self, name):
        return self._of(name).from_original(name)

    def kohya_to_comfy(self, key):
        renamed = self.base.kohya_to_comfy(key)
        return renamed if renamed != key else self.control.kohya_to_comfy(key)


VACE_NAMING = VaceNaming(WAN_NAMING)


# ---- the control channels ---------------------------------------------------------------------------------------
def fold_mask(mask: torch.Tensor, vae_stride: tuple[int, int, int]) -> torch.Tensor:
    """A pixel mask (B, F, H, W) in [0, 1] -> (B, sh*sw, latent frames, H/sh, W/sw): each sh x sw pixel patch's
    values as channels, the frames taken nearest onto the latent frames (diffusers' ``prepare_masks``)."""
    st, sh, sw = vae_stride
    b, f, h, w = mask.shape
    folded = mask.reshape(b, f, h // sh, sh, w // sw, sw).permute(0, 3, 5, 1, 2, 4).flatten(1, 2)
    return torch.nn.functional.interpolate(folded, size=((f + st - 1) // st, h // sh, w // sw), mode="nearest-exact")


@torch.no_grad()
def control_channels(vae, control: torch.Tensor, mask: torch.Tensor, vae_stride: tuple[int, int, int],
                     reference: torch.Tensor | None = None) -> torch.Tensor:
    """The DiT's 96 control channels (B, 96, latent frames (+1 with a reference), H/8, W/8).

    ``control``: (B, 3, F, H, W) in [-1, 1]; ``mask``: (B, 3, F, H, W) in [0, 1], 1 = generate (thresholded at 0.5
    for the two latents, its first channel folded as it is); ``reference``: (B, 3, H, W) in [-1, 1] or None."""
    binary = (mask > 0.5).to(control.dtype)
    latents = torch.cat([encode_video(vae, control * (1 - binary)), encode_video(vae, control * binary)], dim=1)
    folded = fold_mask(mask[:, 0].float(), vae_stride).to(latents.dtype)
    if reference is not None:
        ref = encode_video(vae, reference[:, :, None])
        latents = torch.cat([torch.cat([ref, torch.zeros_like(ref)], dim=1), latents], dim=2)
        folded = torch.cat([torch.zeros_like(folded[:, :, :1]), folded], dim=2)
    return torch.cat([latents, folded], dim=1)


def references(loaded: torch.Tensor | None) -> torch.Tensor | None:
    """The batch's reference images (B, 3, H, W) from the loaded (B, 4, H, W) ``reference_image``: None where no row
    gave one; rows with and without one in a batch are one line (their latents differ in length)."""
    if loaded is None:
        return None
    given = loaded[:, GIVEN].flatten(1).amax(1) > 0.5
    if not bool(given.any()):
        return None
    if not bool(given.all()):
        raise ConfigError("data: a batch mixes rows with and without a reference_image (a reference adds a latent "
                          "frame); give every row one or none, or set data.batch_size=1")
    return loaded[:, :GIVEN]


def masks(control: torch.Tensor, loaded: torch.Tensor | None) -> torch.Tensor:
    """Each sample's mask (B, 3, F, H, W) in [0, 1]: its ``control_mask`` (read as a clip, in [-1, 1]) where its row
    gave one, else all ones. A row without one reads its control video in its place (sample_input_fallbacks): those
    frames equal the control video's exactly, and mean no mask."""
    ones = torch.ones_like(control)
    if loaded is None:
        return ones
    own = (loaded == control).flatten(1).all(1).view(-1, 1, 1, 1, 1)
    return torch.where(own, ones, ((loaded + 1) / 2).clamp(0, 1))


class VaceEncoders(WanEncoders):
    """Wan's encoders; ``cond["vace_context"]`` holds each sample's 96 control channels, and a reference image adds
    its latent as the first latent frame of ``x0``."""

    def __init__(self, vae, text_encoder, tokenizer, text_len: int, vae_stride: tuple[int, int, int]):
        super().__init__(vae, text_encoder, tokenizer, text_len)
        self.vae_stride = tuple(vae_stride)

    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        pixels = batch["pixels"]
        control = batch[CONTROL_VIDEO].to(pixels.dtype)
        ref = references(batch.get(REFERENCE_IMAGE))
        mask = masks(control, batch.get(CONTROL_MASK))
        x0 = encode_video(self.vae, pixels)
        if ref is not None:
            x0 = torch.cat([encode_video(self.vae, ref[:, :, None].to(pixels.dtype)), x0], dim=2)
        return x0, {CONTROL: control_channels(self.vae, control, mask, self.vae_stride, ref)}


# ---- memory -----------------------------------------------------------------------------------------------------
class VaceMemory(WanMemory):
    """Wan's formula for the base blocks (what block swap and checkpointing count) plus the control blocks, always
    on the device: their linears (a block's, and each one's output projection, the first one's input projection
    too) and the control patch embedding. Activations (wanexp's forward, models/wan22/fast.py ControlBranch): the
    base blocks' first input, which every control block reads, one live hint, and each checkpointed control block's
    control tokens (in host memory under offloading: one on its way); without checkpointing, the control blocks'
    activations as base blocks'."""

    def weights_gib(self, config, weight_bytes, other_bytes, resident_blocks):
        n, d = len(config["vace_layers"]), config["num_attention_heads"] * config["attention_head_dim"]
        patch = config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
        extra = ((n + 1) * d * d * weight_bytes + config["vace_in_channels"] * patch * d * other_bytes) / 2**30
        return super().weights_gib(config, weight_bytes, other_bytes, resident_blocks + n) + extra

    def activations_gib(self, config, tokens, checkpointing, offloading, compiled, selective: bool = False):
        n = len(config["vace_layers"])
        if checkpointing:  # selective: the base blocks keep their share (the control blocks checkpoint fully)
            d = config["num_attention_heads"] * config["attention_head_dim"]
            streams = 2 + (1 if offloading else n)
            return (super().activations_gib(config, tokens, checkpointing, offloading, compiled, selective)
                    + streams * tokens * d * 2 / 2**30)
        return super().activations_gib(dict(config, num_layers=config["num_layers"] + n), tokens, checkpointing,
                                       offloading, compiled)


# ---- sampling ---------------------------------------------------------------------------------------------------
def _clip(path, frames: int, height: int, width: int, fps: int | None, start: int = 0, stride: int = 1) -> torch.Tensor:
    """A control video or mask (3, frames, H, W) in [-1, 1]: frames ``start, start + stride, ...`` at ``fps`` (None:
    its own frames), exactly those (it follows its clip frame for frame); an image: its frame repeated."""
    from wanexp.data.media import load_clip
    from wanexp.data.metadata import media_kind

    if media_kind(str(path)) == "video":
        return load_clip(path, frames, height, width, stride, start=start, fps=fps, exact=True)
    return load_clip(path, 1, height, width).expand(-1, frames, -1, -1)


def quantised(image: torch.Tensor) -> torch.Tensor:
    """An image in [-1, 1] on 8-bit steps (what the pipeline's PIL reference image holds)."""
    return ((image + 1) * 127.5).round().clamp(0, 255) / 127.5 - 1


class VaceRunner(WanPipelineRunner):
    """diffusers' WanVACEPipeline given a sample's control video, mask and reference image (``inputs`` by column:
    paths, read as training reads them, videos at ``fps``, the model's rate; a mask path equal to the control
    video's or a reference that is not an image means none). Adapter files of any naming the family reads load
    through peft (both block kinds)."""

    def __init__(self, pipe, fps: int | None):
        super().__init__(pipe)
        self.fps = fps

    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        from PIL import Image

        from wanexp.data.media import load_clip
        from wanexp.data.metadata import media_kind
        from wanexp.models.wan22 import pipeline

        inputs = dict(inputs or {})
        if not inputs.get(CONTROL_VIDEO):
            raise ConfigError("a VACE sample needs its control video (wanexp-sample --control-video)")
        f, h, w = shape["frames"], shape["height"], shape["width"]
        control = _clip(inputs[CONTROL_VIDEO], f, h, w, self.fps)
        given = inputs.get(CONTROL_MASK)
        mask = masks(control[None], _clip(given, f, h, w, self.fps)[None] if given else None)[0]
        ref = inputs.get(REFERENCE_IMAGE)
        refs = None
        if ref and media_kind(str(ref)) == "image":
            px = quantised(load_clip(ref, 1, h, w)[:, 0])
            refs = Image.fromarray(((px + 1) * 127.5).round().byte().permute(1, 2, 0).numpy())
        # (1, F, 3, H, W) in [0, 1]: the pipeline's video processor maps it to [-1, 1] at the same size
        return pipeline.generate(self.pipe, prompt, seed, shape, steps, guidance, negative, device, record, None,
                                 embeds, leading_frames=int(refs is not None),
                                 video=((control + 1) / 2).permute(1, 0, 2, 3)[None],
                                 mask=mask.permute(1, 0, 2, 3)[None], reference_images=refs)

    def load_adapter(self, path, adapter_name, expert):
        from wanexp.adapters import load_adapter_file

        transformer = self.pipe.transformer_2 if expert == "low" else self.pipe.transformer
        load_adapter_file(transformer, path, VACE_NAMING, adapter_name, what=f"--lora {path}")
        return "wanexp.adapters.load_adapter_file"


# ---- the spec ---------------------------------------------------------------------------------------------------
class VaceA14BSpec(T2VA14BSpec):
    """Wan2.2-VACE-Fun-A14B: T2V-A14B's two experts, each a WanVACETransformer3DModel, trained and sampled on a
    control video (and optional mask and reference image). Loaded from a diffusers-format folder; the release
    (VideoX-Fun's layout of the Wan-AI release) converts to one."""

    layout = "vace_a14b"
    transformer_class = "diffusers.WanVACETransformer3DModel"
    pipeline_class = "WanVACEPipeline"
    component_files = False  # a diffusers-format folder (the release converts to one: python -m wanexp.cli.convert)
    cfg_parallel = None
    sequence_parallel = False  # the control branch's hints are not split
    pads_sequence = False
    adapter_naming = VACE_NAMING
    sample_inputs = {
        CONTROL_VIDEO: "the control video (depth, pose, edges, ...) the sample follows, frame for frame",
        CONTROL_MASK: "an image or video, white where the sample is generated, black where the control video is "
                      "kept (default: all white)",
        REFERENCE_IMAGE: "an image of the subject, prepended as a latent frame (default: none)",
    }
    # a row without a mask or a reference reads its control video's path in their place: that means none
    sample_input_fallbacks = {CONTROL_MASK: (CONTROL_VIDEO,), REFERENCE_IMAGE: (CONTROL_VIDEO,)}

    def enable_sequence_parallel(self, transformer, sp, gradient_free=False):
        raise ConfigError(f"parallel.sp_size={sp.size}: model={self.name} (VACE) has no sequence parallel; set "
                          "parallel.sp_size=1")

    def load_sample_input(self, name, path, num_frames, fps, size=None, start=0, stride=1) -> torch.Tensor:
        """``control_video`` and ``control_mask``: (3, num_frames, H, W) in [-1, 1], the clip's window of the file at
        ``fps`` (an image mask: its frame repeated), resized and centre-cropped to ``size`` as the clip is;
        ``reference_image``: (4, H, W), see GIVEN (the control video's path in its place: zeros)."""
        from wanexp.data.media import load_clip
        from wanexp.data.metadata import media_kind

        height, width = size
        if name == REFERENCE_IMAGE:
            if media_kind(path) != "image":
                return torch.zeros(GIVEN + 1, height, width)
            return torch.cat([quantised(load_clip(path, 1, height, width)[:, 0]), torch.ones(1, height, width)])
        return _clip(path, num_frames, height, width, fps, start, stride).contiguous()

    def check_sample_input(self, name, path) -> str | None:
        """A control video that is not a video, a mask that is neither image nor video, a reference that is not an
        image (its control video's path in its place: fine), or a file missing or unreadable: the reason."""
        from wanexp.data.metadata import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, Sample, media_kind
        from wanexp.data.probe import probe_sample

        kind = media_kind(path)
        wanted = {CONTROL_VIDEO: ("video",), CONTROL_MASK: ("video", "image"), REFERENCE_IMAGE: ("image",)}[name]
        if name == REFERENCE_IMAGE and kind == "video":
            return None
        if kind not in wanted:
            exts = sorted(set().union(*({"video": VIDEO_EXTENSIONS, "image": IMAGE_EXTENSIONS}[k] for k in wanted)))
            return f"{name} {path}: not {' or '.join(f'a {k}' for k in wanted)} file (one of {', '.join(exts)})"
        reason = probe_sample(Sample(path=path, prompt="", kind=kind), 1, 1, 16, 16).reason
        return f"{name} {path}: {reason}" if reason else None

    def encoder_info(self):
        """Latents cached for another model are never this one's (its cond id: the control channels)."""
        import dataclasses

        return dataclasses.replace(super().encoder_info(), cond_id="vace_control")

    def load_encoders(self):
        return VaceEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), self.text_len,
                            self.vae_stride)

    def transformer_call(self, transformer, hidden, timestep, text, cond):
        """diffusers' VACE forward with the sample's control channels at scale 1 on every control block."""
        control = cond[CONTROL].to(hidden.dtype)
        scale = control.new_ones(len(transformer.config.vace_layers))
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                           control_hidden_states=control, control_hidden_states_scale=scale, return_dict=False)[0]

    def memory_formula(self):
        return VaceMemory()

    def load_pipeline(self, device, dtype, image):
        return VaceRunner(super().load_pipeline(device, dtype, False).pipe, self.fps)

    def make_pipeline(self, transformers, vae, scheduler, image):
        return VaceRunner(super().make_pipeline(transformers, vae, scheduler, False).pipe, self.fps)


