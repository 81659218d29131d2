"""Knowledge distillation into a smaller student DiT (``objective=kd``): full fine-tuning, the teacher frozen.

The student is a ``WanTransformer3DModel`` with the teacher's config and the overrides in ``objective.student``
(fewer layers, another width); ``num_layers: null`` halves the teacher's. It starts from the teacher where shapes
allow: student block i copies teacher block round(i * (L_t - 1) / (L_s - 1)) (evenly spaced, first and last kept),
and the embeddings, output head and modulation tables are copied when their shapes match; the rest keeps its random
initialisation (the count is printed).

Loss: on noised real latents at a sampled sigma (the boundary's range, the flow-matching sampler), the MSE between
the student's and the teacher's velocity, with the layout's conditioning and loss mask (TI2V: a clean first frame is
left out). The student is exported with every checkpoint as a diffusers pipeline folder (its ``transformer/`` plus
the teacher's VAE, text encoder, tokenizer and scheduler, linked) that ``WanPipeline.from_pretrained`` loads.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from wanexp.errors import ConfigError
from wanexp.objectives.base import Objective, ObjectiveOutput
from wanexp.objectives.flow_matching import FlowMatching, add_noise, masked_mse

STUDENT = "student"


def teacher_block_for(i: int, student_layers: int, teacher_layers: int) -> int:
    """The teacher block a student block starts from: evenly spaced, the first and the last kept."""
    if student_layers == 1:
        return 0
    return round(i * (teacher_layers - 1) / (student_layers - 1))


class KnowledgeDistillation(Objective):
    adapters: tuple[str, ...] = ()  # the teacher stays as loaded; the student is a separate, fully trained model
    export = STUDENT

    def __init__(self, *, name: str, timestep: dict, student: dict):
        """The arguments are the ``objective=kd`` group (config.schema.KDConfig)."""
        super().__init__(name)
        self.noise_levels = FlowMatching(name=name, timestep=timestep)  # its sigma sampler, on the boundary's range
        self.student_overrides = dict(student)
        self.student: nn.Module | None = None
        self._student_denoiser = None

    # ---- the student ---------------------------------------------------------------------------------------------
    def build_trainable(self, transformers: dict, spec) -> dict[str, nn.Module]:
        """Build the student from the (single) loaded teacher; the LightningModule owns and trains what this returns."""
        from diffusers import WanTransformer3DModel

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
            raise ConfigError(f"objective.student: {unknown[0]} is not a WanTransformer3DModel setting; use e.g. "
                              "num_layers, num_attention_heads, attention_head_dim, ffn_dim")
        config.update(overrides)
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        student = WanTransformer3DModel.from_config(config)  # fp32 parameters (mixed precision autocasts)
        copied, total = self._init_from_teacher(student, teacher)
        print(f"wanexp: kd student: {config['num_layers']} of {teacher.config.num_layers} layers, "
              f"{sum(p.numel() for p in student.parameters()) / 1e6:.1f}M parameters; {copied} of {total} tensors "
              "start from the teacher", flush=True)
        student.requires_grad_(True)
        if spec.gradient_checkpointing:
            student.enable_gradient_checkpointing()
        if spec.attention_backend:
            student.set_attention_backend(spec.attention_backend)
        self.student = student
        return {STUDENT: student}

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
    def __call__(self, batch, denoiser, generator=None) -> ObjectiveOutput:
        if self._student_denoiser is None:  # the teacher's denoiser, around the student (same conditioning)
            self._student_denoiser = type(denoiser)(denoiser.spec, {"dense": self.student}, denoiser.sigma_range)
        x0, b = batch.x0, batch.size
        sigma = self.noise_levels.sample_sigmas(b, *denoiser.sigma_range, generator=generator, device="cpu")
        noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
        x_t = add_noise(x0, noise, sigma.to(x0.device))
        batch = replace(batch, cond=denoiser.spec.sample_condition(batch.cond, b, generator))
        with torch.no_grad():
            target = denoiser(x_t, sigma, batch).velocity.float()
        pred = self._student_denoiser(x_t, sigma, batch)
        per_sample = masked_mse(pred.velocity, target, pred.loss_mask)
        flops = self._student_denoiser.step_flops(x0.shape, batch.text.shape[1]) * 1.5  # + the teacher's forward
        return ObjectiveOutput(loss=per_sample.mean(), batch_size=b,
                               metrics={"train/loss_kd": (per_sample.mean().detach(), b)}, flops=flops)

    # ---- export ----------------------------------------------------------------------------------------------------
    def export_checkpoint(self, module, state_dict: dict, out_dir: Path) -> list[Path]:
        """The student as a diffusers pipeline folder ``<model>_student/``, from the checkpoint's (gathered) weights."""
        from diffusers import WanTransformer3DModel

        prefix = f"students.{STUDENT}."
        weights = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        student = WanTransformer3DModel.from_config(self.student.config)
        student.load_state_dict(weights)
        folder = Path(out_dir) / f"{module.spec.name}_student"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        student.save_pretrained(tmp / "transformer")
        base = Path(module.spec.path)
        index = json.loads((base / "model_index.json").read_text())
        for name in index:
            if not name.startswith("_") and name not in ("transformer", "transformer_2") and (base / name).exists():
                os.symlink((base / name).resolve(), tmp / name)  # the teacher's VAE, text encoder, ...: not copied
        index.pop("transformer_2", None)
        index.pop("boundary_ratio", None)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return [folder]
