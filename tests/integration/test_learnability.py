"""Training learns: a tiny Wan DiT trained here from scratch on a toy distribution (squares of colour A), then
LoRA-tuned through wanexp's adapter, flow-matching objective and export on squares of colour B, and distilled by
wanexp's DMD into a 4-step student (tests/learn_toy.py; the GPU case ``learnability`` runs it larger).

Every number is computed from what the models generate. A broken loss sign, a LoRA export that loses the update, or
a DMD update of the wrong sign makes this fail."""
from __future__ import annotations

import copy

import pytest

from tests import learn_toy as T

TOY = T.Toy()


@pytest.fixture(scope="module")
def base():
    transformer, losses = T.train_base(TOY, seed=0)
    return transformer, losses


def test_a_lora_moves_samples_to_the_new_colour_and_the_base_stays(base, tmp_path):
    transformer, losses = base
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20, (losses[:3], losses[-3:])  # the base learnt
    base_hue = T.hue(T.sample_euler(transformer, TOY, 20, seed=10)).mean().item()
    lora_file, _ = T.train_lora(transformer, TOY, tmp_path)
    tuned = T.with_lora_file(transformer, lora_file)  # loaded from the exported file, as diffusers loads it
    lora_hue = T.hue(T.sample_euler(tuned, TOY, 20, seed=10)).mean().item()
    again = T.hue(T.sample_euler(transformer, TOY, 20, seed=10)).mean().item()
    # colour A's hue is +0.5, B's -0.5: the base generates A, the LoRA moves most of the way to B, the base stays
    assert base_hue > 0.3, base_hue
    assert lora_hue < -0.1, (base_hue, lora_hue)
    assert again == pytest.approx(base_hue, abs=1e-6)


def test_a_dmd_student_samples_in_4_steps_closer_to_the_teacher(base):
    transformer, _ = base
    teacher = T.sample_euler(transformer, TOY, TOY.teacher_steps, seed=11)
    student, objective, _ = T.train_dmd(transformer, TOY, seed=2)
    untrained = copy.deepcopy(transformer)
    T.lora_adapter(TOY.lora_rank).apply(untrained, "gen")  # the generator LoRA at its start: the teacher itself
    ref = T.profile(teacher)
    span = float(ref.max() - ref.min())
    before = T.psnr(T.profile(T.sample_student(untrained, objective, TOY, seed=12)), ref, span)
    after = T.psnr(T.profile(T.sample_student(student, objective, TOY, seed=12)), ref, span)
    print(f"4-step student vs {TOY.teacher_steps}-step teacher: PSNR {before:.2f} -> {after:.2f} dB")
    assert after > before + 0.5, (before, after)  # measured: 30.2 -> 38.2 dB
