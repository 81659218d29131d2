"""Sample videos with a trained LoRA through the diffusers pipeline, and compare with the teacher (the base model).

    python -m wanexp.cli.sample --run outputs/demo --prompt "a red ball rolls" --seed 0 --teacher
    python -m wanexp.cli.sample --run outputs/demo --prompt "a red ball rolls" --image ball.png   # image-to-video
    python -m wanexp.cli.sample --run outputs/flf --prompt "a ball rolls" --first a.png --last b.png  # first-last frame
    python -m wanexp.cli.sample --model-path /models/Wan2.2-TI2V-5B-Diffusers --lora my_lora_diffusers.safetensors \
        --prompt "..." --height 704 --width 1280 --frames 121 --steps 50 --guidance 5

``--run DIR`` takes the model folder, the size, the frame rate (``model.fps``) and the LoRA files (``DIR/lora/final``)
of a wanexp run; without it the model group is the one whose layout the folder has. ``--image`` (one per ``--prompt``)
samples image-to-video from that image, resized and centre-cropped to the sample's size as training crops its clips:
TI2V-5B takes one optionally, I2V-A14B always needs one, T2V-A14B refuses it. ``--first`` is ``--image``; ``--last``
(one per ``--prompt``, cropped the same way) is the sample's last frame for a first-last-frame model (``flf2v14b``,
which needs both; a model without first-last-frame conditioning refuses it). A family's own sample inputs are flags
named after their columns, one per ``--prompt`` (S2V's ``--audio``; Animate's ``--pose-video``, ``--face-video``, and
in replacement mode ``--background-video``, ``--mask-video``). A LoRA made by
``objective=dmd`` carries its student steps in its file header: it is sampled with exactly those steps (the shifted
sigmas of training, each step predicting x0 and re-noising it to the next sigma) and no CFG. Otherwise the pipeline's
own scheduler runs ``--steps`` steps with CFG ``--guidance``. The experts serve the steps as in training
(``wanexp.generation.expert_routing``): a distilled one-expert A14B LoRA (boundary=low or high) runs every student step
on its expert; otherwise steps route by the boundary, the untrained side on that expert's base weights. The same
``--seed`` gives the same video (a distilled LoRA's re-noising draws from the seed's generator). ``--teacher`` also
samples the base model (the LoRA off, both experts routed by the boundary; ``--teacher-steps``/``--teacher-guidance``)
with the same prompts, seeds and images (a DMD run's teacher is the one it was distilled toward: CFG
``objective.guidance_scale`` with ``objective.negative_prompt``; the flags override them), and reports the
student-teacher gap (latent MSE, PSNR and SSIM of the decoded frames) in ``<out>/metrics.json``, which also lists the
expert (and whether the LoRA was on) of each transformer call.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from wanexp.errors import ConfigError, MediaError, UserError, refuse

# The sampling functions live in wanexp.generation (the validation callback uses them too), imported where they are
# used: --help and a bad argument answer before torch or diffusers is imported.


# The flags of a family's per-sample control inputs: (flag, the sample input's column, what it is).
CONTROL_FLAGS = (("--control-video", "control_video", "the control video the sample follows (required)"),
                 ("--control-mask", "control_mask", "the mask, white where the sample is generated (default: all)"),
                 ("--reference-image", "reference_image", "an image of the subject (default: none)"))


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m wanexp.cli.sample", description=__doc__.splitlines()[0])
    ap.add_argument("--run", "--run-dir", dest="run",
                    help="a wanexp run folder: model, size and LoRA files from it (--run-dir: the same; the "
                         "spelling to use under torchrun, whose own --run-path makes --run ambiguous there)")
    ap.add_argument("--model-path", help="local diffusers-format Wan2.2 folder (default: the run's model.path)")
    ap.add_argument("--lora", action="append", default=[],
                    help="a *_diffusers.safetensors LoRA file (repeat for an A14B pair; *_low_noise_* goes to the "
                         "low-noise expert); default: the run's lora/final")
    ap.add_argument("--ema", action="store_true",
                    help="with --run: the run's EMA LoRA files (callbacks.ema) instead of its raw ones")
    ap.add_argument("--prompt", action="append", default=[], help="repeat for several prompts")
    ap.add_argument("--image", "--first", dest="image", action="append", default=[],
                    help="image-to-video: the first frame of the prompt's sample, one per --prompt in their order "
                         "(resized and centre-cropped to the sample's size)")
    ap.add_argument("--last", action="append", default=[],
                    help="first-last-frame to video (model flf2v14b): the last frame of the prompt's sample, one per "
                         "--prompt in their order (resized and centre-cropped like --first)")
    ap.add_argument("--audio", action="append", default=[],
                    help="speech-to-video (S2V): the audio the prompt's sample is driven by, one per --prompt in their "
                         "order (a .wav/.mp3/.flac or a video with an audio track); muxed into its mp4. Audio longer "
                         "than --frames continues as further clips")
    for flag, col, what in CONTROL_FLAGS:
        ap.add_argument(flag, dest=col, action="append", default=[],
                        help=f"VACE (model vace14b): {what}, one per --prompt in their order (read at the sample's "
                             "size as training reads it)")
    ap.add_argument("--seed", type=int, action="append", default=[], help="repeat for several seeds (default 0)")
    ap.add_argument("--negative-prompt", help="CFG's negative prompt (default: a DMD run's objective.negative_prompt, "
                                              "else the empty prompt)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--fps", type=int, help="the videos' frame rate (default: the model's native one, model.fps)")
    ap.add_argument("--steps", type=int, default=50, help="steps for a LoRA that is not distilled")
    ap.add_argument("--guidance", type=float, default=5.0, help="CFG for a LoRA that is not distilled")
    ap.add_argument("--teacher", action="store_true", help="also sample the base model (LoRA off) and compare")
    ap.add_argument("--teacher-steps", type=int, default=50)
    ap.add_argument("--teacher-guidance", type=float,
                    help="the teacher's CFG (default: a DMD run's objective.guidance_scale, else 5)")
    ap.add_argument("--out", help="output folder (default: RUN/samples, else outputs/samples)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is present)")
    ap.add_argument("--save-latents", action="store_true",
                    help="also write each sample's final latents (<name>_latents.safetensors, fp32): to decode or "
                         "compare them later")
    ap.add_argument("--gpus", type=int, default=1,
                    help="generate on N processes of this host (GPU 0..N-1, or N CPU processes with --device cpu), "
                         "split as --sp/--cfg-parallel say (default: CFG parallel when N is even and the sample "
                         "uses CFG, sequence parallel over the rest)")
    ap.add_argument("--sp", type=int,
                    help="sequence-parallel size: the processes that split each transformer call's video tokens "
                         "(default: all the processes not taken by --cfg-parallel)")
    ap.add_argument("--cfg-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="the conditional and unconditional halves of each CFG step on different processes (2 x --sp "
                         "processes). Default: on for an even process count without --sp when the sample uses CFG "
                         "and the model's pipeline supports it; --no-cfg-parallel: sequence parallel over all")
    ap.add_argument("--shard", action="store_true",
                    help="shard each transformer's weights over the processes (FSDP2, loaded rank by rank from the "
                         "safetensors files): each GPU holds 1/N of them, for models that do not fit one card")
    ap.add_argument("--offload-experts", action="store_true",
                    help="a two-expert model (A14B): only the expert whose steps run on the GPU, the other in pinned "
                         "host memory until its steps start (one move per expert and sample); with --shard, for two "
                         "32 GB cards")
    ap.add_argument("--compile", action="store_true",
                    help="compile each transformer block (torch.compile, a GPU of compute capability 8.0 or more): "
                         "the first sample pays the compilation")
    ap.add_argument("--timeout", type=int, default=900,
                    help="seconds a process waits for the others at each phase (start, prompts, weights, each "
                         "sample) before it names the late rank and stops")
    args, extra = ap.parse_known_args(argv)
    args.inputs = _input_flags(ap, extra)
    return args


def _input_flags(ap, extra: list[str]) -> list[tuple[str, str]]:
    """The model family's own sample inputs given as ``--<input> PATH`` (an input column's name with dashes, e.g.
    ``--pose-video``: ModelSpec.sample_inputs), one per --prompt: (name, path) pairs in order. Whether the model takes
    them is checked once the model is known; anything else unparsed is argparse's one-line error."""
    pairs, rest = [], list(extra)
    while rest:
        flag = rest.pop(0)
        name, _, value = flag.partition("=")
        if not (name.startswith("--") and len(name) > 2 and name[2:].replace("-", "").isalnum()):
            ap.error(f"unrecognized arguments: {flag}")
        if not value:
            if not rest or rest[0].startswith("--"):
                ap.error(f"argument {name}: expected one argument")
            value = rest.pop(0)
        pairs.append((name[2:].replace("-", "_"), value))
    return pairs


def _settings(args) -> dict:
    """Model folder and group, size, frame rate, text length, LoRA files, the teacher's CFG and negative prompt and
    the conditioning images from the arguments and the run folder; every input checked before any weight loads."""
    s = {"model_path": args.model_path, "height": args.height, "width": args.width, "frames": args.frames,
         "loras": [Path(p) for p in args.lora], "text_len": 512, "out": args.out, "boundary_ratio": None,
         "model": None, "teacher_guidance": args.teacher_guidance, "negative_prompt": args.negative_prompt}
    if args.run:
        run = Path(args.run)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--run {run}: no config.yaml there; pass a wanexp run folder (paths.output_dir)")
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(run / "config.yaml")
        s["model_path"] = s["model_path"] or cfg.model.path
        s["height"], s["width"] = s["height"] or cfg.data.height, s["width"] or cfg.data.width
        s["frames"] = s["frames"] or cfg.data.num_frames
        s["text_len"] = int(cfg.model.text_len)
        s["boundary_ratio"] = cfg.model.get("boundary_ratio")  # the experts' boundary the run trained with
        s["model"] = cfg.model
        # a distilled run's teacher: the CFG scale and negative prompt the student was distilled toward
        if s["teacher_guidance"] is None:
            s["teacher_guidance"] = cfg.objective.get("guidance_scale")
        if s["negative_prompt"] is None:
            s["negative_prompt"] = cfg.objective.get("negative_prompt")
        from wanexp.generation import run_adapter_files

        s["loras"] = s["loras"] or run_adapter_files(run / "lora" / "final", ema=args.ema)  # LoHa: its _comfyui
        s["out"] = s["out"] or str(run / "samples")
    if not s["model_path"] or not Path(s["model_path"]).is_dir():
        raise ConfigError(f"--model-path {s['model_path']}: not a model folder; pass --model-path or --run with a run "
                          "folder")
    for p in s["loras"]:
        if not p.is_file():
            raise ConfigError(f"--lora {p}: file not found")
    if not args.prompt:
        raise ConfigError("no --prompt given; pass one or more --prompt \"...\"")
    s["height"], s["width"], s["frames"] = s["height"] or 480, s["width"] or 832, s["frames"] or 81
    s["out"] = Path(s["out"] or "outputs/samples")
    model = s["model"] or _folder_model(Path(s["model_path"]), last=bool(args.last))
    s["fps"] = args.fps or int(model.get("fps") or _folder_model(Path(s["model_path"])).fps)  # a run before model.fps
    s["teacher_guidance"] = 5.0 if s["teacher_guidance"] is None else float(s["teacher_guidance"])
    s["negative_prompt"] = s["negative_prompt"] or ""
    from wanexp.models.family import load_class

    spec = load_class(str(model._target_))
    s["images"] = _images(args, spec, model.name, s["height"], s["width"])
    s["inputs"] = _inputs(args, s, model)
    _last_images(args, spec, model.name, s)
    _control_inputs(args, spec, model.name, s)
    s["model_group"] = model
    s["layout"] = _layout(args, spec, s)
    return s


def _layout(args, spec, s):
    """The processes' grid (wanexp.parallel.generation.layout) for this launch, its sequence split checked against
    the transformer's heads and the sample's tokens: before anything loads."""
    from wanexp.parallel.generation import check_split, layout

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: the number of processes is at least 1")
    world = int(os.environ.get("WORLD_SIZE") or args.gpus)
    if os.environ.get("WORLD_SIZE") and args.gpus > 1 and world != args.gpus:
        raise ConfigError(f"--gpus {args.gpus} under a launcher of {world} processes: leave out --gpus when "
                          "torchrun starts the processes")
    split = spec.sequence_parallel  # the family splits tokens
    cfg = args.cfg_parallel
    if cfg is None:  # both halves of every CFG step at once: no communication inside the step (its best split)
        cfg = (args.sp is None and world > 1 and world % 2 == 0 and spec.cfg_parallel is not None
               and _uses_cfg(args, s))
    if world > 1 and not split and args.sp is None and not cfg:
        raise ConfigError(f"{world} processes: model={s['model_group'].name} has no sequence parallel; add "
                          "--cfg-parallel (2 processes, or 2 x --sp) and/or --shard with --sp 1")
    grid = layout(world, args.sp, cfg)
    if args.offload_experts and len(set(spec_experts(s))) < 2:
        raise ConfigError(f"--offload-experts: model={s['model_group'].name} has one transformer, nothing to move "
                          "aside; leave out --offload-experts")
    if args.shard and grid.world == 1:
        raise ConfigError("--shard splits the weights over several processes: add --gpus N (or run it under "
                          "torchrun --nproc_per_node=N)")
    if grid.cfg > 1 and spec.cfg_parallel is None:
        raise ConfigError(f"--cfg-parallel: model={s['model_group'].name}'s pipeline does not split its CFG pairs; "
                          "leave out --cfg-parallel")
    if grid.sp > 1 and not split:
        raise ConfigError(f"--sp {grid.sp}: model={s['model_group'].name} has no sequence parallel; use --sp 1 with "
                          "--cfg-parallel and/or --shard")
    if grid.sp > 1:
        config = _spec(s, None).transformer_config(spec_experts(s)[0])
        ft, fh, fw = spec.vae_stride
        pt, ph, pw = spec.patch
        tokens = (((s["frames"] - 1) // ft + 1) // pt) * (s["height"] // (fh * ph)) * (s["width"] // (fw * pw))
        check_split(None if spec.pads_sequence else tokens, int(config["num_attention_heads"]), grid.sp)
    return grid


def _uses_cfg(args, s) -> bool:
    """Whether the samples run CFG: not for a distilled LoRA (its header's student steps) or --guidance 1."""
    from wanexp.generation import lora_header

    distilled = any("wanexp_student_timesteps" in lora_header(p) for p in s["loras"])
    return args.guidance > 1 and not distilled


def _inputs(args, s, model) -> list[dict]:
    """Each prompt's family inputs (``--audio`` and ``--<input>`` for the model's sample inputs, e.g. S2V's audio,
    Animate's pose and face videos): [] for none. An input given is given once per --prompt; every one is needed
    when the family's sampler has no default for them (``ModelSpec.sampling_needs_inputs``; audio: always). A flag
    the model does not take, a count that does not match the prompts' or a missing file is one line."""
    spec = _spec(dict(s, model_group=model), None)
    names = tuple(spec.sample_inputs)  # the instance's: they may depend on a mode
    given: dict[str, list[str]] = {"audio": list(args.audio)} if args.audio else {}
    for name, path in args.inputs:
        given.setdefault(name, []).append(path)
    for name in names if spec.sampling_needs_inputs else [n for n in names if n == "audio"]:
        given.setdefault(name, [])
    for name, paths in given.items():
        flag = "--" + name.replace("_", "-")
        if name not in names:
            have = ", ".join("--" + n.replace("_", "-") for n in names) or "none"
            raise ConfigError(f"{flag}: model={model.name} takes no {name} (its sample inputs: {have}); leave out "
                              f"{flag}")
        if len(paths) != len(args.prompt):
            raise ConfigError(f"{flag} given {len(paths)} time(s) for {len(args.prompt)} --prompt(s) (model="
                              f"{model.name} samples from one each): pass one {flag} per --prompt, in the same order")
        for p in paths:
            if not Path(p).is_file():
                raise ConfigError(f"{flag} {p}: file not found")
    return [{name: paths[i] for name, paths in given.items()} for i in range(len(args.prompt))] if given else []


def _last_images(args, spec, model: str, s: dict) -> None:
    """Each prompt's ``--last`` added to its family inputs (``last_image``, an image path the pipeline crops to the
    sample's size). A model without first-last-frame conditioning, a count that does not match the prompts' or a
    missing or unreadable file is one line."""
    takes = "last_image" in spec.sample_inputs
    if args.last and not takes:
        raise ConfigError(f"--last: model={model} has no first-last-frame conditioning; leave out --last, or sample a "
                          "first-last-frame model (flf2v14b: the I2V-A14B weights)")
    if takes and len(args.last) != len(args.prompt):
        raise ConfigError(f"--last given {len(args.last)} time(s) for {len(args.prompt)} --prompt(s) (model={model} "
                          "is first-last-frame to video): pass one --last per --prompt, in the same order")
    from wanexp.generation import condition_image

    for p in args.last:
        try:
            condition_image(p, s["height"], s["width"])
        except MediaError as e:
            raise ConfigError(f"--last {e}") from None
    if args.last:
        s["inputs"] = [dict(given, last_image=p) for given, p in zip(s["inputs"] or [{}] * len(args.last), args.last)]


def _control_inputs(args, spec, model: str, s: dict) -> None:
    """Each prompt's ``--control-video`` (and ``--control-mask``, ``--reference-image``) added to its family inputs
    under its column's name. A flag the model does not take, a count that does not match the prompts' (a required
    input: one per prompt; an optional one: none or one per prompt) or a missing file is one line."""
    for flag, col, _ in CONTROL_FLAGS:
        given = getattr(args, col)
        if given and col not in spec.sample_inputs:
            raise ConfigError(f"{flag}: model={model} takes no {col}; leave out {flag}, or sample a VACE model "
                              "(vace14b)")
        required = col in spec.sample_inputs and col not in spec.sample_input_fallbacks
        if (given or required) and len(given) != len(args.prompt):
            raise ConfigError(f"{flag} given {len(given)} time(s) for {len(args.prompt)} --prompt(s) (model={model} "
                              f"takes a {col} per sample): pass one {flag} per --prompt, in the same order")
        for p in given:
            if not Path(p).is_file():
                raise ConfigError(f"{flag} {p}: file not found")
        if given:
            s["inputs"] = [dict(have, **{col: p}) for have, p in zip(s["inputs"] or [{}] * len(given), given)]


def spec_experts(s) -> list[str]:
    """The experts of the sampled model group (``model.experts``)."""
    return list(s["model_group"].experts)


def _folder_model(path: Path, last: bool = False):
    """The model group (conf/model) of a model folder sampled without ``--run``: of the groups of released models
    (those without a tiny ``build``), the one whose spec's DiT has the folder's transformer's input and output
    channels, a group whose spec recognises the folder itself (``is_release_folder``: S2V's release, Animate's DiT
    class) before one that matches by channels; of two with the same weights (I2V-A14B and its first-last-frame
    variant), the one that takes a last frame when ``last`` (``--last`` given), else the other. Its spec says how the
    model takes an image; its ``fps``, the rate the videos are written at."""
    from wanexp.config import model_group, model_group_files
    from wanexp.models.family import ModelSpec, load_class

    config = path / "transformer" / "config.json"
    t = json.loads(config.read_text()) if config.is_file() else {}
    channels = (t.get("in_channels"), t.get("out_channels"))
    released = {name: own for name, own in model_group_files().items() if own.get("build") is None}
    found = []
    for name, own in released.items():  # a group that names no spec class takes its defaults' (composed)
        spec = load_class(str(own.get("_target_") or model_group(name, "--model-path")._target_))
        diffusers_format = spec.is_release_folder.__func__ is ModelSpec.is_release_folder.__func__
        own_folder = spec.is_release_folder(path)
        same_class = t.get("_class_name") in (None, spec.transformer_class.rpartition(".")[2])  # e.g. a VACE DiT
        if own_folder or (diffusers_format and same_class and (spec.in_channels, spec.latent_channels) == channels):
            found.append((not own_folder, ("last_image" in spec.sample_inputs) != last, name))
    if found:
        return model_group(min(found)[-1], "--model-path")
    if not (path / "model_index.json").is_file():  # a release in its own layout: its family's advice
        from wanexp.composition import build
        from wanexp.config import compose

        for name in released:
            advice = build(compose([f"model={name}", f"model.path={path}"]).model).not_diffusers_hint(path)
            if advice:
                raise ConfigError(f"--model-path {path}: {advice.replace('model.path', '--model-path')}")
    raise ConfigError(f"--model-path {path}: its transformer (in/out channels {channels[0]}/{channels[1]}) is none "
                      f"of the model groups' ({', '.join(released)}); pass a diffusers folder of one of them, or "
                      "--run with the run folder")


def _images(args, spec, model: str, height: int, width: int) -> list:
    """The first frame of each prompt's sample (``--image``, one per ``--prompt``) as the pipeline takes it, cropped
    to the sample's size as training crops its clips; [] for text-to-video. A model without image conditioning, a
    count that does not match the prompts' or a missing or unreadable file is one line."""
    if args.image and not (spec.needs_image_latent or spec.draws_first_frame or spec.reference_image):
        raise ConfigError(f"--image: model={model} has no image conditioning (text-to-video only); leave out --image, "
                          "or sample a TI2V-5B or I2V-A14B model")
    if (args.image or spec.needs_image_latent) and len(args.image) != len(args.prompt):
        need = f" (model={model} is image-to-video)" if spec.needs_image_latent else ""
        raise ConfigError(f"--image given {len(args.image)} time(s) for {len(args.prompt)} --prompt(s){need}: pass "
                          "one --image per --prompt, in the same order")
    if not args.image:
        return []
    from wanexp.generation import condition_image

    try:
        return [condition_image(p, height, width) for p in args.image]
    except MediaError as e:
        raise ConfigError(f"--image {e}") from None


def _lora_expert(path: Path, header: dict, modules: dict) -> str:
    """The expert a LoRA file adapts: its wanexp header, else its name (``*_low_noise*``: the low-noise expert)."""
    expert = header.get("wanexp_expert") or ("low" if "_low_noise" in path.name else next(iter(modules)))
    if expert not in modules:
        raise ConfigError(f"--lora {path}: a LoRA of the {expert} expert, but the model folder has "
                          f"{'/'.join(modules)}; pass --model-path of the model the LoRA was trained on")
    return expert


# The allocator setting training applies (parallel.env): growing segments instead of fixed ones, so that memory freed
# between the steps and the VAE decode is reused whole (on a 28 GiB cap, S2V's decode after the sharded steps met
# 4 GiB reserved but unusable)
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def main(argv=None) -> dict:
    import sys

    for key, value in ALLOCATOR.items():  # before CUDA starts in this process (and in the processes it launches)
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    from wanexp.parallel import generation as multi

    try:
        s = _settings(args)
        if args.gpus > 1 and not multi.launched() and "WORLD_SIZE" not in os.environ:
            sys.exit(multi.launch(_without_gpus(argv), args.gpus))  # N processes of this command, then their end
        return _main(args, s)
    except UserError as e:
        if multi.launched():  # the launcher prints the first rank's line
            multi.report(str(e))
            sys.exit(2)
        refuse(str(e))
    except multi.RankFailure as e:
        multi.report(str(e))
        sys.exit(1)


def _without_gpus(argv: list[str]) -> list[str]:
    """The arguments each launched process gets: these, less ``--gpus N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--gpus":
            skip = True
        elif not a.startswith("--gpus="):
            out.append(a)
    return out


def _main(args, s) -> dict:
    import torch

    from wanexp.generation import expert_routing, lora_header, psnr, recorded_experts, ssim, write_mp4
    from wanexp.parallel import generation as multi

    grid = multi.start(args.device, s["layout"], args.timeout)
    if grid is not None:
        device = grid.device
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    leader = grid is None or grid.leader
    spec = _spec(s, device, compile=args.compile)
    image = bool(s["images"])
    seeds = args.seed or [0]
    multi.set_phase("encoding the prompts")
    embeds = _embeddings(spec, args.prompt, s, device, grid)
    multi.arrive(grid, "encoding the prompts")
    multi.set_phase("loading the weights")
    pipe = _load(spec, s, device, grid, image, args.shard)
    pipe.grid = grid
    modules = pipe.experts
    distilled, trained = None, []
    for path in s["loras"]:
        header = lora_header(path)
        expert = _lora_expert(path, header, modules)
        pipe.load_adapter(path, f"wanexp_{expert}", expert)  # each kind by its route
        trained.append(expert)
        if "wanexp_student_timesteps" in header:
            distilled = ([float(t) for t in header["wanexp_student_timesteps"].split(",")],
                         float(header["wanexp_student_shift"]))
    offload = None
    if args.offload_experts:  # the first expert stays; the others wait in host memory until their steps
        from wanexp.models.expert_offload import ExpertOffload

        distinct = {id(m): (name, m) for name, m in modules.items()}
        offload = ExpertOffload(dict(distinct.values()), device).attach(next(iter(distinct.values()))[0])
    multi.arrive(grid, "loading the weights")
    held = multi.gather(grid, offload.held_bytes() if offload else _weight_bytes(modules))  # per rank, as loaded
    ratio = s["boundary_ratio"] if s["boundary_ratio"] is not None else pipe.boundary_ratio
    routing = expert_routing(list(modules), ratio, trained, distilled is not None)  # as the training routed
    teacher_routing = expert_routing(list(modules), ratio, [], False)
    if distilled:  # exactly the training's student steps, no CFG
        pipe.use_student(*distilled)
        steps, guidance = len(distilled[0]), 1.0
    else:
        steps, guidance = args.steps, args.guidance
    out = s["out"]
    if leader:
        out.mkdir(parents=True, exist_ok=True)
    negative = s["negative_prompt"]
    results = {"model_path": str(s["model_path"]), "loras": [str(p) for p in s["loras"]],
               "distilled": bool(distilled), "steps": steps, "guidance": guidance, "fps": s["fps"],
               "negative_prompt": negative, "routing": dataclasses.asdict(routing), "samples": [],
               "processes": {"world": 1 if grid is None else grid.world, "sp": s["layout"].sp,
                             "cfg": s["layout"].cfg, "weight_bytes": held}}
    if args.teacher:
        results["teacher"] = {"steps": args.teacher_steps, "guidance": s["teacher_guidance"]}

    def one(prompt, seed, n_steps, cfg, img, rt, phase, inputs):
        multi.set_phase(phase)
        start = time.perf_counter()
        with pipe.routed(rt), multi.cfg_split(grid, list(modules.values()), embeds[negative], cfg, spec.cfg_parallel):
            got = pipe.generate(prompt, seed, s, n_steps, cfg, negative, device, record, img,
                                embeds=(embeds[prompt], embeds[negative]),
                                **({"inputs": inputs} if inputs else {}))
        multi.arrive(grid, phase)
        timing.append({"sample": phase, "seconds": round(time.perf_counter() - start, 3), "steps": n_steps,
                       "denoise_s": round(clock.pop("end") - clock.pop("start"), 3)})  # the next sample starts anew
        return got

    timing: list[dict] = []
    clock: dict = {}  # this sample's first transformer call's start and last call's end (_denoise_clock)
    # each transformer call's timestep (the last token's: a clean TI2V first frame has 0), the expert that served
    # it with its adapter on or off, and what this rank's first blocks computed (calls, tokens per call)
    with pipe.recorded_timesteps() as record, recorded_experts(modules) as served, \
            _block_work(spec, modules, results["processes"], clock):
        for i, prompt in enumerate(args.prompt):
            img = s["images"][i] if s["images"] else None
            inputs = s["inputs"][i] if s["inputs"] else None
            for seed in seeds:
                served.clear()
                name = f"p{i}_s{seed}"
                lat, video, used = one(prompt, seed, steps, guidance, img, routing, f"sample {name}", inputs)
                sound = pipe.soundtrack(inputs, video.shape[0], s["fps"]) if leader and inputs else None
                entry = {"prompt": prompt, "seed": seed, "file": str(out / f"{name}.mp4"), "timesteps": used,
                         "experts": [list(x) for x in served], "latents": lat}
                if leader:
                    write_mp4(out / f"{name}.mp4", video, s["fps"], audio=sound)
                    if args.save_latents:
                        _save_latents(out / f"{name}_latents.safetensors", lat)
                if img is not None:
                    entry["image"] = args.image[i]
                if inputs:
                    entry.update(inputs)
                if args.teacher:
                    if s["loras"]:
                        pipe.adapters_on(False)
                    if distilled:
                        pipe.use_student(None)
                    t_lat, t_video, _ = one(prompt, seed, args.teacher_steps, s["teacher_guidance"], img,
                                            teacher_routing, f"teacher sample {name}", inputs)
                    entry.update(teacher_file=str(out / f"{name}_teacher.mp4"),
                                 latent_mse=float(((lat - t_lat) ** 2).mean()))
                    if leader:
                        write_mp4(out / f"{name}_teacher.mp4", t_video, s["fps"], audio=sound)
                        entry.update(psnr=psnr(video, t_video), ssim=ssim(video, t_video))
                    if s["loras"]:
                        pipe.adapters_on(True)
                    if distilled:
                        pipe.use_student(*distilled)
                results["samples"].append(entry)
                if leader:
                    print(f"wanexp: wrote {entry['file']}" + (f" (vs teacher: latent MSE {entry['latent_mse']:.4g}, "
                                                             f"PSNR {entry['psnr']:.2f} dB, SSIM {entry['ssim']:.3f})"
                                                             if args.teacher else ""), flush=True)
    if offload is not None:
        results["processes"]["expert_moves"] = dict(offload.moves)  # arrivals on the device, per expert
    results["timing"] = timing  # each sample's wall seconds (its decode included), steps, and the steps' seconds
    results["processes"]["peak_gib"] = multi.gather(grid, _peak_gib(device))  # per rank
    if leader:  # the latents stay in the returned results (for callers), not in metrics.json
        saved = dict(results, samples=[{k: v for k, v in e.items() if k != "latents"} for e in results["samples"]])
        (out / "metrics.json").write_text(json.dumps(saved, indent=2))
    multi.finish(grid)
    return results


@contextmanager
def _block_work(spec, modules: dict, into: dict, clock: dict):
    """Count the calls of each transformer's first block on this process and the most tokens one call held, into
    ``into`` (``block_calls``, ``block_tokens``): a split over processes shows there (a CFG-parallel rank computes
    half of the calls, a sequence-parallel one its share of the tokens). ``clock``: see :func:`_denoise_clock`."""
    into.update(block_calls=0, block_tokens=0)

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        into.update(block_calls=into["block_calls"] + 1, block_tokens=max(into["block_tokens"], hidden.shape[1]))

    handles = [spec.blocks(t)[0].register_forward_pre_hook(hook, with_kwargs=True) for t in _distinct(modules)]
    handles += _denoise_clock(modules, clock)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _denoise_clock(modules: dict, clock: dict) -> list:
    """Hooks that keep in ``clock`` the start of a sample's first transformer call (``start``, set while there is
    none: the caller pops it after each sample) and the end of its latest (``end``, the GPU's work included): the
    sample's steps alone, no text encoding, no decode. Returns the hook handles."""
    import torch

    def start(module, args, kwargs):
        clock.setdefault("start", time.perf_counter())

    def end(module, args, kwargs, output):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        clock["end"] = time.perf_counter()

    handles = []
    for m in _distinct(modules):
        handles.append(m.register_forward_pre_hook(start, with_kwargs=True))
        handles.append(m.register_forward_hook(end, with_kwargs=True))
    return handles


def _distinct(modules: dict) -> list:
    """The transformers of ``modules`` (expert name -> module), each once (one module may serve two experts)."""
    return list({id(m): m for m in modules.values()}.values())


def _weight_bytes(modules: dict) -> int:
    """Bytes of the transformers' weights this process holds (its shards of a sharded one)."""
    total = 0
    for m in _distinct(modules):
        for p in m.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def _peak_gib(device) -> float | None:
    """The most GPU memory this process's tensors held (None on the CPU)."""
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _save_latents(path: Path, latents) -> None:
    """A sample's final latents as a safetensors file (key ``latents``), written aside and renamed into place."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({"latents": latents.contiguous()}, str(tmp))
    tmp.replace(path)


def _spec(s, device, compile: bool = False):
    """The model group's spec for sampling the folder ``s["model_path"]`` (whatever the run's path): its dtypes on a
    GPU, fp32 on the CPU; blocks compiled only with ``compile``, without the run's ``model.cuda_graphs`` (a training
    setting: sampling on several GPUs runs collectives inside the blocks)."""
    from wanexp.composition import build

    cpu = {} if device is None or device.type == "cuda" else {"dtype": "fp32", "vae_dtype": "fp32",
                                                                "text_encoder_dtype": "fp32"}
    return build(s["model_group"], path=str(s["model_path"]), compile=compile, cuda_graphs=False, **cpu)


def _embeddings(spec, prompts: list[str], s, device, grid) -> dict:
    """Each prompt's and the negative prompt's text embedding (CPU), by the model folder's text encoder on
    ``device``, loaded for this and freed before the transformers load. On several processes each encodes its share
    of the texts and they exchange them; every process loads the encoder (one with no share encodes a text it
    drops), so the GPUs' peaks stay equal."""
    import torch

    texts = list(dict.fromkeys([*prompts, s["negative_prompt"]]))
    mine = texts if grid is None else texts[grid.rank::grid.world]
    got = spec.encode_prompts(mine or texts[:1], device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from wanexp.parallel.generation import gather

    embeds: dict = {}
    for part in gather(grid, {t: got[t] for t in mine}):
        embeds.update(part)
    return embeds


def _load(spec, s, device, grid, image: bool, shard: bool):
    """The family's pipeline around its transformers (each expert of the model), its VAE and scheduler on
    ``device``; under sequence parallel the transformers split every call's tokens over the branch's ranks;
    ``shard``: each transformer sharded over every rank (wanexp.models.sharded)."""
    transformers = {}
    mesh = None
    if shard and grid is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (grid.world,))
    for expert in spec_experts(s):
        if mesh is not None:
            t = spec.load_transformer_sharded(expert, device, mesh)
        else:
            t = spec.load_transformer(expert).to(device).eval()
        if grid is not None and grid.sp_group is not None:
            spec.enable_sequence_parallel(t, grid.sp_group, gradient_free=True)
        transformers[expert] = t
    vae = spec.load_vae().to(device)
    return spec.make_pipeline(transformers, vae, spec.load_scheduler(), image)


def entry() -> None:
    """The console command (wanexp-sample): main() returns its results for callers; a command returns nothing."""
    main()


if __name__ == "__main__":
    main()
