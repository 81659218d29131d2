"""Knowledge distillation into a smaller student DiT (``objective=kd``): full fine-tuning, the teacher frozen.

The student is the family's DiT class with the teacher's config and the overrides in ``objective.student``
(fewer layers, another width); ``num_layers: null`` halves the teacher's. It starts from the teacher where shapes
allow: student block i copies teacher block round(i * (L_t - 1) / (L_s - 1)) (evenly spaced, first and last kept),
and the embeddings, output head and modulation tables are copied when their shapes match; the rest keeps its random
initialisation (the count is printed).

Loss: on noised real latents at a sampled sigma (the boundary's range, the flow-matching sampler), the MSE between
the student's and the teacher's velocity, with the layout's conditioning and loss mask (TI2V: a clean first frame is
left out). With ``objective.feature_weight`` > 0 it adds that weight times the MSE between each student block's output
and the output of the teacher block it started from (intermediate feature matching; the student must keep the
teacher's width), averaged over the student's blocks. The student is exported with every checkpoint as a diffusers pipeline folder (its dense expert's folder plus
the teacher's VAE, text encoder, tokenizer and scheduler, linked) that the family's pipeline loads.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from wanexp.config.schema import KDConfig
from wanexp.errors import ConfigError
from wanexp.objectives.base import Objective, ObjectiveOutput, draw_noise, to_device
from wanexp.objectives.flow_matching import FlowMatching, add_noise, masked_mse

STUDENT = "student"


def teacher_block_for(i: int, student_layers: int, teacher_layers: int) -> int:
    """The teacher block a student block starts from: evenly spaced, the first and the last kept."""
    if student_layers == 1:
        return 0
    return round(i * (teacher_layers - 1) / (student_layers - 1))


class KnowledgeDistillation(Objective):
    adapters: tuple[str, ...] = ()  # the teacher stays as loaded; the student is a separate, fully trained model
    one_forward = False  # the teacher's and the student's forwards
    export = STUDENT
    schema = KDConfig

    @classmethod
    def check(cls, cfg) -> None:
        m, b, o, sp_size = cfg.model, cfg.boundary, cfg.objective, cfg.parallel.sp_size
        if sp_size > 1 and o.feature_weight > 0:
            raise ConfigError(f"parallel.sp_size={sp_size} with objective.feature_weight={o.feature_weight:g}: the "
                              "student's blocks see 1/sp of the tokens, the teacher's all; set "
                              "objective.feature_weight=0 or parallel.sp_size=1")
        if b.name == "full" and m.boundary_ratio is not None:
            raise ConfigError(f"objective=kd with model={m.name} boundary=full: KD distils one DiT into a student; use "
                              "boundary=high or boundary=low to distil one expert")
        swap = m.get("blocks_to_swap") or 0  # a count or auto
        if swap or m.get("fp8_storage"):
            knob = f"model.blocks_to_swap={swap}" if swap else "model.fp8_storage=true"
            raise ConfigError(f"{knob} with objective=kd: the student is built from the teacher's weights; set "
                              f"{'model.blocks_to_swap=0' if swap else 'model.fp8_storage=false'}")

    def __init__(self, *, name: str, timestep: dict, student: dict, feature_weight: float = 0.0):
        """The arguments are the ``objective=kd`` group (config.schema.KDConfig)."""
        super().__init__(name)
        self.noise_levels = FlowMatching(name=name, timestep=timestep)  # its sigma sampler, on the boundary's range
        self.student_overrides = dict(student)
        self.feature_weight = float(feature_weight)
        self.student: nn.Module | None = None
        self._student_denoiser = None
        self._pairs: list[tuple[int, int]] = []  # (student block, teacher block) whose outputs are matched
        self._features: dict[tuple[str, int], torch.Tensor] | None = None  # captured during one loss evaluation

    # ---- the student ---------------------------------------------------------------------------------------------
    def build_trainable(self, transformers: dict, spec) -> dict[str, nn.Module]:
        """Build the student from the (single) loaded teacher; the LightningModule owns and trains what this returns."""
        if len(transformers) != 1:
            raise ConfigError(f"objective=kd distils one DiT; model={spec.name} loaded {list(transformers)}: use "
                              "boundary=high or boundary=low to distil one A14B expert")
        teacher = next(iter(transformers.values()))
        config = dict(teacher.config)
        overrides = dict(self.student_overrides)
        if overrides.get("num_layers") is None:
            overrides["num_layers"] = max(1, (config["num_layers"] + 1) // 2)
        unknown = sorted(set(overrides) - set(config))
        if unknown:
            raise ConfigError(f"objective.student: {unknown[0]} is not a {type(teacher).__name__} setting; use e.g. "
                              "num_layers, num_attention_heads, attention_head_dim, ffn_dim")
        config.update(overrides)
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        student = spec.transformer_type().from_config(config)  # fp32 parameters (mixed precision autocasts)
        copied, total = self._init_from_teacher(student, teacher)
        print(f"wanexp: kd student: {config['num_layers']} of {teacher.config.num_layers} layers, "
              f"{sum(p.numel() for p in student.parameters()) / 1e6:.1f}M parameters; {copied} of {total} tensors "
              "start from the teacher", flush=True)
        student.requires_grad_(True)
        if spec.gradient_checkpointing:
            student.enable_gradient_checkpointing()
        spec.set_attention_backend(student)
        self.student = student
        if self.feature_weight > 0:
            self._hook_features(student, teacher, spec)
        return {STUDENT: student}

    def _hook_features(self, student: nn.Module, teacher: nn.Module, spec) -> None:
        """Forward hooks that keep each student block's output and its teacher block's, while a loss is evaluated."""
        s_dim = student.config.num_attention_heads * student.config.attention_head_dim
        t_dim = teacher.config.num_attention_heads * teacher.config.attention_head_dim
        if s_dim != t_dim:
            raise ConfigError(f"objective.feature_weight={self.feature_weight:g} matches block outputs, so the student "
                              f"needs the teacher's width ({t_dim}; it has {s_dim}): keep num_attention_heads x "
                              "attention_head_dim, or set objective.feature_weight=0")
        s_layers, t_layers = student.config.num_layers, teacher.config.num_layers
        self._pairs = [(i, teacher_block_for(i, s_layers, t_layers)) for i in range(s_layers)]

        def keep(key):
            def hook(module, args, output):
                if self._features is not None and key not in self._features:  # not a checkpoint's recompute
                    self._features[key] = output
            return hook

        for i, j in self._pairs:
            spec.blocks(student)[i].register_forward_hook(keep(("student", i)))
            spec.blocks(teacher)[j].register_forward_hook(keep(("teacher", j)))

    @staticmethod
    def _init_from_teacher(student: nn.Module, teacher: nn.Module) -> tuple[int, int]:
        t_sd = {k.replace(".base_layer.", "."): v for k, v in teacher.state_dict().items() if ".lora_" not in k}
        s_layers, t_layers = student.config.num_layers, teacher.config.num_layers
        new, copied = {}, 0
        for key, value in student.state_dict().items():
            src = key
            if key.startswith("blocks."):
                i, rest = key.split(".", 2)[1:]
                src = f"blocks.{teacher_block_for(int(i), s_layers, t_layers)}.{rest}"
            if src in t_sd and t_sd[src].shape == value.shape:
                new[key] = t_sd[src].to(value.dtype)
                copied += 1
            else:
                new[key] = value
        student.load_state_dict(new)
        return copied, len(new)

    # ---- the loss --------------------------------------------------------------------------------------------------
    def __call__(self, batch, denoiser, generator=None, *, step: int = 0, negative_text=None) -> ObjectiveOutput:
        if self._student_denoiser is None:  # the teacher's denoiser, around the student (same conditioning)
            self._student_denoiser = type(denoiser)(denoiser.spec, {"dense": self.student}, denoiser.sigma_range)
        x0, b = batch.x0, batch.size
        sigma = self.noise_levels.sample_sigmas(b, *denoiser.sigma_range, generator=generator, device="cpu")
        noise = draw_noise(x0.shape, x0.dtype, x0.device, generator)
        x_t = add_noise(x0, noise, to_device(sigma, x0.device))
        batch = replace(batch, cond=denoiser.spec.sample_condition(batch.cond, b, generator))
        self._features = {} if self._pairs else None
        try:
            with torch.no_grad():
                target = denoiser(x_t, sigma, batch).velocity.float()
            pred = self._student_denoiser(x_t, sigma, batch)
            features = self._features
        finally:
            self._features = None
        per_sample = masked_mse(pred.velocity, target, pred.loss_mask)
        loss = per_sample.mean()
        metrics = {"train/loss_kd": (loss.detach(), b)}
        if features is not None:
            feature_loss = torch.stack([
                ((features[("student", i)].float() - features[("teacher", j)].float()) ** 2).mean()
                for i, j in self._pairs]).mean()
            loss = loss + self.feature_weight * feature_loss
            metrics["train/loss_kd_features"] = (feature_loss.detach(), b)
        flops = self._student_denoiser.step_flops(x0.shape, batch.text.shape[1]) * 1.5  # + the teacher's forward
        return ObjectiveOutput(loss=loss, batch_size=b, metrics=metrics, flops=flops)

    # ---- export ----------------------------------------------------------------------------------------------------
    def export_checkpoint(self, module, state_dict: dict, out_dir: Path) -> list[Path]:
        """The student as a diffusers pipeline folder ``<model>_student/``, from the checkpoint's (gathered) weights."""
        prefix = f"students.{STUDENT}."
        weights = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        student = module.spec.transformer_type().from_config(self.student.config)
        student.load_state_dict(weights)
        folder = Path(out_dir) / f"{module.spec.name}_student"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        experts = set(module.spec.expert_folders.values())  # the student is the dense expert; no other is kept
        student.save_pretrained(tmp / module.spec.expert_folders["dense"])
        base = Path(module.spec.path)
        index = json.loads((base / "model_index.json").read_text())
        for name in index:
            if not name.startswith("_") and name not in experts and (base / name).exists():
                os.symlink((base / name).resolve(), tmp / name)  # the teacher's VAE, text encoder, ...: not copied
        for name in experts - {module.spec.expert_folders["dense"]}:
            index.pop(name, None)
        index.pop("boundary_ratio", None)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return [folder]
