"""objective=kd: a smaller student DiT learns the frozen teacher's velocity and is saved as a loadable pipeline."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import compose_cfg, module_from
from tests.integration.conftest import tiny_run
from wanexp.models.encoders import EncodedBatch
from wanexp.objectives.kd import teacher_block_for


def test_student_blocks_are_spread_over_the_teacher():
    assert [teacher_block_for(i, 3, 30) for i in range(3)] == [0, 14, 29]
    assert [teacher_block_for(i, 15, 30) for i in (0, 14)] == [0, 29] and teacher_block_for(0, 1, 30) == 0


def _kd_module(shared_dir, extra=()):
    """A DiffusionModule with objective=kd on the tiny model (configured: teacher loaded, student built), and its spec."""
    module = module_from(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", "objective=kd",
                                      *extra]))
    module.configure_model()
    return module, module.spec


def test_the_student_loss_falls_on_a_fixed_batch_and_only_the_student_trains(shared_dir):
    module, spec = _kd_module(shared_dir)
    student = module.students["student"]
    teacher = module.transformers["dense"]
    assert student.config.num_layers == 1 and teacher.config.num_layers == 2
    assert all(n.startswith("students.student.") for n in module.trainable_names)
    assert torch.equal(student.blocks[0].ffn.net[2].weight, teacher.blocks[0].ffn.net[2].weight)  # from the teacher
    teacher_before = {n: p.clone() for n, p in teacher.named_parameters()}
    g = torch.Generator().manual_seed(0)
    batch = EncodedBatch(torch.randn(2, 48, 3, 4, 4, generator=g), torch.randn(2, spec.text_len, 32, generator=g))
    from wanexp.models.denoiser import Denoiser

    as_student = Denoiser(spec, {"dense": student}, module.denoiser.sigma_range)
    x_t, sigma = torch.randn(batch.x0.shape, generator=g), torch.tensor([0.3, 0.8])

    def gap() -> float:  # the student-teacher velocity error, measured apart from the training loss
        with torch.no_grad():
            return float(((as_student(x_t, sigma, batch).velocity - module.denoiser(x_t, sigma, batch).velocity) ** 2)
                         .mean())

    before = gap()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    losses = []
    for _ in range(40):
        loss = module.objective(batch, module.denoiser, torch.Generator().manual_seed(1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]
    assert gap() < 0.7 * before, (before, gap())
    assert all(torch.equal(p, teacher_before[n]) for n, p in teacher.named_parameters())


def test_kd_run_exports_a_student_pipeline_that_reloads_with_the_same_output(shared_dir, tmp_path):
    from diffusers import WanPipeline

    r = tiny_run(shared_dir, tmp_path / "run", ["objective=kd", "trainer.max_steps=3"])
    folder = Path(r["output_dir"]) / "lora" / "final" / "tiny_student"
    assert r["lora_files"] == [str(folder)]
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    loaded, trained = pipe.transformer, r["module"].students["student"]
    assert loaded.config.num_layers == 1
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 48, 3, 8, 8, generator=g)
    text = torch.randn(1, 16, loaded.config.text_dim, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        a = loaded(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        b = trained.eval()(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    assert torch.equal(a, b)
    teacher = r["module"].transformers["dense"]
    assert not torch.equal(trained.blocks[0].ffn.net[2].weight, teacher.blocks[0].ffn.net[2].weight)  # it trained


def test_feature_matching_adds_the_block_output_gap_to_the_loss(shared_dir):
    import pytest

    from wanexp.errors import ConfigError

    g = torch.Generator().manual_seed(0)

    def loss_of(module, spec):
        batch = EncodedBatch(torch.randn(2, 48, 3, 4, 4, generator=g), torch.randn(2, spec.text_len, 32, generator=g))
        return module.objective(batch, module.denoiser, torch.Generator().manual_seed(1))

    # a student that copies the whole teacher: no velocity gap, no feature gap
    full, spec = _kd_module(shared_dir, ["objective.student.num_layers=2", "objective.feature_weight=1.0"])
    out = loss_of(full, spec)
    assert out.loss.item() < 1e-10 and out.metrics["train/loss_kd_features"][0].item() < 1e-10  # fp32 rounding
    # half the layers: student block 0 copies teacher block 0, and its output is compared with that block's
    half, spec = _kd_module(shared_dir, ["objective.feature_weight=0.5"])
    with torch.no_grad():  # move the student away from its teacher block
        half.students["student"].blocks[0].ffn.net[2].weight.add_(0.05)
    out = loss_of(half, spec)
    kd, feat = out.metrics["train/loss_kd"][0].item(), out.metrics["train/loss_kd_features"][0].item()
    assert feat > 0 and abs(out.loss.item() - (kd + 0.5 * feat)) < 1e-6 * max(1.0, out.loss.item())
    out.loss.backward()
    assert half.students["student"].blocks[0].ffn.net[2].weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="needs the teacher's width"):
        _kd_module(shared_dir, ["objective.feature_weight=0.5", "+objective.student.num_attention_heads=1"])
