"""The LightningModule: a model spec + the flow-matching objective + LoRA on each trained expert."""
from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn

from wanexp import lora
from wanexp.models.encode import encode_image_condition, encode_text, encode_video
from wanexp.models.spec import WanSpec
from wanexp.objectives.flow_matching import FlowMatchingObjective, add_noise, masked_mse, velocity_target
from wanexp.perf import transformer_step_flops

SIGMA_BUCKETS = 4  # train/loss_t<k> covers shifted sigma in [k/4, (k+1)/4)


class WanLoraModule(L.LightningModule):
    def __init__(self, spec: WanSpec, objective: FlowMatchingObjective, boundary: dict, max_steps: int = -1,
                 load_encoders: bool = True):
        super().__init__()
        self.spec, self.objective = spec, objective
        self.boundary_name = boundary["name"]
        self.sigma_range = (float(boundary["sigma_min"]), float(boundary["sigma_max"]))
        self.expert_names = spec.trained_experts(self.boundary_name)
        self.transformers = nn.ModuleDict()
        self.vae = self.text_encoder = self.tokenizer = None
        self.trainable_names: list[str] = []
        self.flops_since_step = 0.0  # read and reset by the status callback once per optimizer step
        self.max_steps = max_steps
        self.load_encoders = load_encoders  # False when every batch carries cached latents and text embeddings
        # Checkpoints hold the LoRA weights only; the frozen base comes from model.path.
        self.strict_loading = False

    # ---- building -------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if len(self.transformers):
            return
        lc = self.objective.lora
        for e in self.expert_names:
            t = self.spec.load_transformer(e)
            lora.add_lora(t, int(lc["rank"]), float(lc["alpha"]), float(lc.get("dropout", 0.0)),
                          list(lc["targets"]), list(lc["attention"]))
            if lc.get("init_from"):
                lora.load_lora_into(t, lc["init_from"])
            self.transformers[e] = t
        if self.load_encoders:
            self.vae = self.spec.load_vae()
            self.text_encoder = self.spec.load_text_encoder()
            self.tokenizer = self.spec.load_tokenizer()
        self.trainable_names = [n for n, p in self.named_parameters() if p.requires_grad]
        parallelize = getattr(self._trainer.strategy, "parallelize_module", None) if self._trainer else None
        if parallelize is not None:  # FSDP: shard after LoRA is added, before optimizers exist
            parallelize(self)
        # Every rank loads the same frozen weights from disk: DDP need not broadcast or watch them.
        trainable = set(self.trainable_names)
        self._ddp_params_and_buffers_to_ignore = [n for n, _ in self.named_parameters() if n not in trainable] + [
            n for n, _ in self.named_buffers()
        ]

    def train(self, mode: bool = True):
        super().train(mode)
        for frozen in (self.vae, self.text_encoder):  # no dropout in the encoders, ever
            if frozen is not None:
                frozen.eval()
        return self

    # ---- the step -------------------------------------------------------------------------------------------
    def encode(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Batch -> (x0 latents fp32, text embeddings, conditioning). Cached batches already hold latents."""
        cond = {}
        if "latents" in batch:
            x0, text = batch["latents"].float(), batch["text"]
            if "image_latent" in batch:
                cond["image_latent"] = batch["image_latent"]
            return x0, text, cond
        pixels = batch["pixels"]
        with torch.autocast(device_type=pixels.device.type, enabled=False):
            x0 = encode_video(self.vae, pixels)
            if self.spec.needs_image_latent:
                cond["image_latent"] = encode_image_condition(self.vae, pixels[:, :, 0], pixels.shape[2])
            text = encode_text(self.tokenizer, self.text_encoder, list(batch["prompt"]), self.spec.text_len)
        return x0, text, cond

    def flow_loss(self, x0: torch.Tensor, text: torch.Tensor, cond: dict, generator: torch.Generator | None = None):
        """Flow-matching loss of one batch. Returns (mean loss, sigma, per-sample loss, expert per sample)."""
        b, dev = x0.shape[0], x0.device
        sigma = self.objective.sample_sigmas(b, *self.sigma_range, generator=generator, device=dev)
        noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(dev)
        x_t = add_noise(x0, noise, sigma)
        # TI2V-style first-frame conditioning on a fraction of multi-frame samples (specs that don't use it ignore it).
        draw = torch.rand(b, generator=generator).to(dev)
        cond = dict(cond, first_frame=(draw < float(self.objective.first_frame_cond)) & (x0.shape[2] > 1))
        hidden, timestep, mask = self.spec.model_inputs(x_t, x0, sigma, cond)
        target = velocity_target(x0, noise)
        routes = self.spec.route(sigma, self.expert_names)
        per_sample = torch.zeros(b, device=dev, dtype=torch.float32)
        for expert in dict.fromkeys(routes):
            idx = torch.tensor([i for i, r in enumerate(routes) if r == expert], device=dev)
            transformer = self.transformers[expert]
            dtype = transformer.patch_embedding.weight.dtype  # the base weights' dtype (bf16-true converts them)
            pred = transformer(
                hidden_states=hidden[idx].to(dtype),
                timestep=timestep[idx],
                encoder_hidden_states=text[idx].to(dtype),
                return_dict=False,
            )[0]
            per_sample = per_sample.index_put((idx,), masked_mse(pred, target[idx], None if mask is None else mask[idx]))
        return per_sample.mean(), sigma, per_sample, routes

    def training_step(self, batch: dict, batch_idx: int):
        x0, text, cond = self.encode(batch)
        loss, sigma, per_sample, routes = self.flow_loss(x0, text, cond)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"train/loss is {loss.item()} at step {self.global_step}; lower objective.optim.lr or use "
                "trainer.precision=bf16-mixed with model.dtype=bf16"
            )
        bs = x0.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        detached = per_sample.detach()
        for expert in self.expert_names if len(self.expert_names) > 1 else []:
            sel = [i for i, r in enumerate(routes) if r == expert]
            if sel:
                self.log(f"train/loss_{expert}", detached[sel].mean(), batch_size=len(sel))
        buckets = (sigma.detach() * SIGMA_BUCKETS).long().clamp(max=SIGMA_BUCKETS - 1)
        for k in buckets.unique().tolist():
            sel = buckets == k
            self.log(f"train/loss_t{k}", detached[sel].mean(), batch_size=int(sel.sum()))
        transformer_config = next(iter(self.transformers.values())).config
        self.flops_since_step += transformer_step_flops(transformer_config, x0.shape, text.shape[1],
                                                        checkpointing=self.spec.gradient_checkpointing)
        return loss

    # ---- optimisation ---------------------------------------------------------------------------------------
    def configure_optimizers(self):
        o = self.objective.optim
        params = [p for n, p in self.named_parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=float(o["lr"]), betas=tuple(o.get("betas", (0.9, 0.999))),
                                eps=float(o.get("eps", 1e-8)), weight_decay=float(o.get("weight_decay", 0.0)))
        total = self.max_steps if self.max_steps and self.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(o.get("scheduler", "constant"), int(o.get("warmup_steps", 0)), total,
                           float(o.get("min_lr_ratio", 0.0)))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints hold trainable weights only -------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = set(self.trainable_names)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["wanexp"] = {"model": self.spec.name, "experts": self.expert_names, "boundary": self.boundary_name}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "state_dict" not in checkpoint:  # FSDP loads weights itself before this hook
            return
        missing = [n for n in self.trainable_names if n not in checkpoint["state_dict"]]
        if missing:
            raise ValueError(
                f"resume: the checkpoint lacks {len(missing)} LoRA weights of this run (e.g. {missing[0]}); it was "
                "written by a run with other model/boundary/objective.lora settings: resume with those"
            )


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    """Linear warm-up then constant, cosine or linear decay to ``min_ratio``."""
    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"objective.optim.scheduler={kind!r}: allowed values are constant, cosine, linear")

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * (1 - progress)

    return f
