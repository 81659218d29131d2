"""Sequence parallel (wanexp/models/sequence.py) computes the one-process function: 2 gloo processes with sp=2 give
the output, the loss and (after the data-parallel average DDP/FSDP apply) the LoRA gradients of one process with sp=1.

Tiny random Wan DiTs in fp32 with peft LoRA (B randomised so every LoRA tensor gets a gradient). The TI2V case has a
per-token timestep (a clean first frame) and 3 latent frames of 24 tokens split 36/36 between the ranks, so a rank's
share starts and ends inside a frame; one case runs with activation checkpointing (the recompute repeats the
all-to-alls); one has 45 tokens (3 frames of 15), padded to 46 so rank 1 holds a padding token. The S2V DiT (models/s2v/transformer.py; every parameter trained) splits its whole sequence of noisy,
reference and motion tokens: 103 tokens, padded to 104, so rank 0 ends inside the third noisy frame (the audio
cross-attention's frames cut) and rank 1 holds a padding token; with gradients and checkpointing, and without
gradients as generation runs it.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.test_perf_fast import tiny_transformer
from wanexp.models import sequence
from wanexp.models.wan22 import sequence as wan_sequence
from wanexp.models.wan22 import fast

CASES = {  # name: (per-token timestep, activation checkpointing, heads, latent (frames, height, width))
    "t2v": (False, False, 2, (3, 8, 12)),
    "ti2v_frames_split_mid_frame": (True, False, 2, (3, 8, 12)),
    "ti2v_checkpointed_4_heads": (True, True, 4, (3, 8, 12)),
    "ti2v_padded_45_tokens": (True, True, 2, (3, 6, 10)),  # 45 tokens padded to 46: rank 1 holds the padding
}


def _inputs(per_token: bool, grid=(3, 8, 12)):
    g = torch.Generator().manual_seed(1)
    f, h, w = grid
    hidden = torch.randn(1, 48, f, h, w, generator=g)  # 3 frames x (4 x 6) tokens = 72 tokens by default
    text = torch.randn(1, 7, 32, generator=g)
    tokens, per_frame = f * h * w // 4, h * w // 4
    if per_token:
        timestep = torch.full((1, tokens), 700.0)
        timestep[:, :per_frame] = 0.0  # the clean first frame
    else:
        timestep = torch.tensor([700.0])
    return hidden, timestep, text


def _model(ckpt: bool, heads: int):
    from tests.unit import test_perf_fast

    saved = dict(test_perf_fast.TINY)
    test_perf_fast.TINY.update(num_attention_heads=heads, attention_head_dim=32 // heads)
    try:
        t = tiny_transformer()
    finally:
        test_perf_fast.TINY.clear()
        test_perf_fast.TINY.update(saved)
    fast.use_frame_modulation(t)
    if ckpt:
        t.enable_gradient_checkpointing()
    return t


def _loss_and_grads(t, hidden, timestep, text):
    out = t(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    loss = (out.float() ** 2).mean()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in t.named_parameters() if p.requires_grad}


S2V_CASES = {"s2v_checkpointed": True, "s2v_generation": False}  # name: with gradients (and checkpointing)


def _s2v(ckpt: bool):
    from wanexp.models.s2v import build
    from wanexp.models.s2v.transformer import WanS2VTransformer

    t = build.randomize_(WanS2VTransformer(**build.tiny_config()), seed=3)
    if ckpt:
        t.enable_gradient_checkpointing()
    return t.requires_grad_(ckpt)


def _s2v_inputs(t):
    c, g = t.config, torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(1, c.in_dim, 3, 8, 10, generator=g), timestep=torch.tensor([600.0]),
                encoder_hidden_states=torch.randn(1, 7, c.text_dim, generator=g),
                ref_latents=torch.randn(1, c.in_dim, 1, 6, 10, generator=g),
                audio_features=torch.randn(1, c.audio_layers, c.audio_dim, 12, generator=g),
                motion_latents=torch.randn(1, c.in_dim, 19, 8, 10, generator=g))  # 60 + 15 + 28 = 103 tokens


def _s2v_run(t, grad: bool):
    with torch.set_grad_enabled(grad):
        out = t(**_s2v_inputs(t))
    if not grad:
        return out, None, {}
    loss = (out ** 2).mean()
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in t.named_parameters() if p.grad is not None}


def _worker(rank: int, port: int, result_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for case, (per_token, ckpt, heads, grid) in CASES.items():  # every case in one pair of processes (one start-up)
        t = _model(ckpt, heads)
        wan_sequence.enable(t, sequence.build_group(2))
        out, loss, grads = _loss_and_grads(t, *_inputs(per_token, grid))
        for g in grads.values():  # what DDP / FSDP do with the gradients: the average over all ranks
            dist.all_reduce(g)
            g /= 2
        results[case] = {"out": out, "loss": loss, "grads": grads}
        del t
    from wanexp.models.s2v.spec import S2VSpec

    for case, grad in S2V_CASES.items():
        t = _s2v(grad)
        S2VSpec.enable_sequence_parallel(None, t, sequence.build_group(2), gradient_free=not grad)
        out, loss, grads = _s2v_run(t, grad)
        for g in grads.values():
            dist.all_reduce(g)
            g /= 2
        results[case] = {"out": out, "loss": loss, "grads": grads}
        del t
    if rank == 0:
        torch.save(results, result_path)
    dist.barrier()  # leave together: a gloo peer that exits while the other still works can abort it
    del results  # the models held the sp groups: free them while the interpreter is whole
    dist.destroy_process_group()
    # Skip interpreter finalization: a gloo group torn down there can abort the process ("terminate called without
    # an active exception", SIGABRT) after the work is done, which failed CI once.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sp2_results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sp") / "sp.pt")
    mp.start_processes(_worker, args=(_free_port(), path), nprocs=2, start_method="spawn")
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("case", list(CASES))
def test_sp2_matches_one_process(case, sp2_results):
    per_token, ckpt, heads, grid = CASES[case]
    ref_out, ref_loss, ref_grads = _loss_and_grads(_model(ckpt, heads), *_inputs(per_token, grid))
    got = sp2_results[case]
    torch.testing.assert_close(got["out"], ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["loss"], ref_loss, rtol=1e-5, atol=1e-7)
    assert set(got["grads"]) == set(ref_grads) and any("lora_A" in n for n in ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", list(S2V_CASES))
def test_s2v_sp2_matches_one_process(case, sp2_results):
    grad = S2V_CASES[case]
    ref_out, ref_loss, ref_grads = _s2v_run(_s2v(grad), grad)
    got = sp2_results[case]
    torch.testing.assert_close(got["out"], ref_out, rtol=1e-5, atol=1e-6)
    if grad:
        torch.testing.assert_close(got["loss"], ref_loss, rtol=1e-5, atol=1e-7)
        assert set(got["grads"]) == set(ref_grads) and any("audio_injector" in n for n in ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_modulation_rows_follow_the_split_inside_frames():
    """3 frames of 24 tokens over 2 ranks: rank 0 holds frame 0 and half of frame 1, rank 1 the rest."""
    temb = torch.arange(3.0).view(1, 3, 1)  # one row per frame
    rows = {}
    for r in range(2):
        sp = sequence.SequenceGroup(None, 2, r, 0, 1)
        rows[r] = sequence.shard_modulation(temb, 72, sp)
    per_token = {r: rows[r].repeat_interleave(36 // rows[r].shape[1], dim=1).flatten().tolist() for r in rows}
    assert per_token[0] == [0.0] * 24 + [1.0] * 12 and per_token[1] == [1.0] * 12 + [2.0] * 24


def test_heads_that_do_not_divide_fail_with_one_line():
    from wanexp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"40 attention heads do not divide by 3; .* \(e.g. 2, 4, 5, 8, 10, 20\)"):
        sequence.check_heads(40, 3)


def test_each_data_parallel_rank_draws_its_own_noise_and_a_sequence_group_shares_it():
    from types import SimpleNamespace

    from wanexp.context import RunContext
    from wanexp.module import DiffusionModule

    def seed_after_setup(rank: int, sp: int) -> int:
        torch.manual_seed(7)  # what seed_everything(7) left on every rank
        fake = SimpleNamespace(seed=7, run_context=RunContext(sp_size=sp),
                               trainer=SimpleNamespace(global_rank=rank, world_size=4))
        DiffusionModule.setup(fake, "fit")
        return torch.initial_seed()

    assert seed_after_setup(0, 1) == 7  # rank 0 keeps the run's seed (one-process runs unchanged)
    assert len({seed_after_setup(r, 1) for r in range(4)}) == 4  # data parallel: one stream per rank
    assert seed_after_setup(1, 2) == seed_after_setup(0, 2) != seed_after_setup(2, 2) == seed_after_setup(3, 2)


def test_a_bucket_whose_tokens_do_not_split_fails_at_data_setup_with_one_line():
    from wanexp.data.datamodule import check_sequence_split
    from wanexp.errors import MetadataError

    stride, patch = (4, 16, 16), (1, 2, 2)  # TI2V-5B
    check_sequence_split([(17, 704, 1280), (1, 704, 1280)], stride, patch, 8)  # 4,400 and 880 tokens
    with pytest.raises(MetadataError, match=r"bucket 17x480x544 .* 1275 DiT tokens, which do not split into 4"):
        check_sequence_split([(17, 704, 1280), (17, 480, 544)], stride, patch, 4)


def test_padding_takes_the_last_frames_modulation_rows():
    """3 frames of 15 tokens (45) over 2 ranks, padded to 46: rank 0 holds frame 0 and 8 tokens of frame 1, rank 1
    the rest of frame 1, frame 2 and the padding token (frame 2's rows)."""
    temb = torch.arange(3.0).view(1, 3, 1)
    rows = {r: sequence.shard_modulation(temb, 45, sequence.SequenceGroup(None, 2, r, 0, 1), padded=46)
            for r in range(2)}
    per_token = {r: rows[r].repeat_interleave(23 // rows[r].shape[1], dim=1).flatten().tolist() for r in rows}
    assert per_token[0] == [0.0] * 15 + [1.0] * 8 and per_token[1] == [1.0] * 7 + [2.0] * 16
    padded = sequence.pad_to_ranks(torch.ones(1, 45, 3), sequence.SequenceGroup(None, 2, 0, 0, 1))
    assert padded.shape == (1, 46, 3) and padded[:, 45].abs().sum() == 0
