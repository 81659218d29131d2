"""Pure pieces the training step wires: expert routing, the TI2V first-frame draw, text encoding (padding, cleaning),
and the batch sampler's split over data-parallel ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wanexp.data.datamodule import BucketBatchSampler
from wanexp.models.wan22.encoders import clean_prompt, encode_text
from tests.conftest import compose_cfg
from wanexp.composition import build
from wanexp.models.wan22.spec import WanSpec


def ti2v_spec(first_frame_cond: float):
    return build(compose_cfg(["model.path=/m", f"model.first_frame_cond={first_frame_cond}"]).model)

# ---- expert routing -------------------------------------------------------------------------------------------


def route(sigma, loaded, boundary_ratio):
    """Wan's routing (WanSpec.route) at this boundary."""
    return WanSpec.route(SimpleNamespace(boundary_ratio=boundary_ratio), sigma, loaded)


def test_route_sends_each_sample_to_the_expert_that_owns_its_sigma():
    sigma = torch.tensor([0.95, 0.875, 0.874, 0.1, 1.0, 0.0])
    assert route(sigma, ["high", "low"], 0.875).tolist() == [0, 0, 1, 1, 0, 1]
    assert route(sigma, ["low", "high"], 0.875).tolist() == [1, 1, 0, 0, 1, 0]  # indexes follow the loaded order
    assert route(sigma, ["low"], 0.875).tolist() == [0] * 6  # one loaded expert takes everything
    assert route(sigma, ["dense"], None).tolist() == [0] * 6


# ---- TI2V first-frame conditioning draw -----------------------------------------------------------------------


def test_ti2v_draws_first_frame_conditioning_at_the_configured_rate():
    spec = ti2v_spec(0.25)
    g = torch.Generator().manual_seed(0)
    first = spec.sample_condition({}, 20000, g)["first_frame"]
    assert first.dtype == torch.bool and abs(first.float().mean().item() - 0.25) < 0.01
    assert not ti2v_spec(0.0).sample_condition({}, 100, g)["first_frame"].any()


def test_ti2v_images_never_condition_on_a_first_frame():
    spec = ti2v_spec(1.0)
    x0 = torch.randn(2, 48, 1, 4, 4)
    cond = spec.sample_condition({}, 2)
    hidden, timestep, mask = spec.model_inputs(x0 * 0 + 7, x0, torch.tensor([0.5, 0.5]), cond)
    assert torch.equal(hidden, x0 * 0 + 7) and (timestep == 500).all() and mask.all()


# ---- text encoding --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    from transformers import UMT5Config, UMT5EncoderModel

    from wanexp.models.wan22.build import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"), 32)
    te = UMT5EncoderModel(UMT5Config(d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8, vocab_size=260,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    return tok, te


def test_text_embeddings_are_zero_past_each_prompts_length(tiny_text):
    tok, te = tiny_text
    prompts = ["a red ball", "a much longer prompt about a blue square moving left"]
    emb = encode_text(tok, te, prompts, 32)
    assert emb.shape == (2, 32, 16)
    for i, p in enumerate(prompts):
        n = len(tok(p).input_ids)  # bytes + </s>
        assert (emb[i, n:] == 0).all() and (emb[i, :n].abs().sum(-1) > 0).all()
    # the padding changes nothing of the real tokens: same as encoding the prompt alone at its own length
    alone = encode_text(tok, te, prompts[:1], 32)
    assert torch.allclose(alone[0], emb[0], atol=1e-6)


def test_prompts_are_cleaned_before_encoding(tiny_text):
    tok, te = tiny_text
    assert clean_prompt("  a &amp;amp; b\n\t c  ") == "a & b c"
    dirty = encode_text(tok, te, ["  a &amp;amp; b\n\t c  ", "caf\u00c3\u00a9  au   lait"], 32)
    clean = encode_text(tok, te, ["a & b c", "caf\u00e9 au lait"], 32)
    assert torch.equal(dirty, clean)


# ---- data-parallel batches ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_batch_sampler_gives_each_rank_a_disjoint_slice(world):
    keys = [(17, 64, 64)] * 25 + [(1, 64, 64)] * 14 + [(17, 64, 96)] * 9
    per_rank = [list(BucketBatchSampler(keys, batch_size=2, rank=r, world_size=world, seed=3)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same number of batches on every rank: no collective hangs
    seen = [i for batches in per_rank for b in batches for i in b]
    assert set(seen) == set(range(len(keys)))  # every sample trains in the epoch
    # a bucket's last step is filled with repeats of its own samples, and nothing else repeats
    step = world * 2
    fill = sum(-n % step for n in (25, 14, 9))
    assert len(seen) == len(keys) + fill
    for batches in per_rank:
        assert all(len(b) == 2 and len({keys[i] for i in b}) == 1 for b in batches)  # one shape per batch
    # the same step on every rank draws from the same shape, so a step's tensors match across ranks
    for step in zip(*per_rank):
        assert len({keys[b[0]] for b in step}) == 1
    assert len(per_rank[0]) == len(BucketBatchSampler(keys, 2, 0, world, seed=3))


def test_token_budget_batches_more_short_samples_and_fewer_long_ones():
    from wanexp.data.datamodule import dit_tokens

    assert dit_tokens((17, 704, 1280), (4, 16, 16), (1, 2, 2)) == 4400  # TI2V-5B 704x1280x17
    assert dit_tokens((81, 480, 832), (4, 8, 8), (1, 2, 2)) == 32760  # A14B 480x832x81
    assert dit_tokens((1, 704, 1280), (4, 16, 16), (1, 2, 2)) == 880
    keys = [(17, 64, 64)] * 12 + [(1, 64, 64)] * 12
    sizes = {(17, 64, 64): 2, (1, 64, 64): 6}
    batches = list(BucketBatchSampler(keys, 1, 0, 2, seed=0, batch_sizes=sizes))
    assert sorted(len(b) for b in batches) == [2, 2, 2, 6]  # per rank: 12 videos / (2 x 2), 12 images / (6 x 2)
    assert all(len({keys[i] for i in b}) == 1 for b in batches)


def test_aspect_ratio_buckets():
    from wanexp.data.datamodule import bucket_shapes, nearest_resolution
    from wanexp.data.metadata import Sample

    res = [(704, 1280), (1280, 704), (960, 960)]  # (height, width)
    assert nearest_resolution(1920, 1080, res) == (704, 1280)  # landscape source (width, height)
    assert nearest_resolution(1080, 1920, res) == (1280, 704)
    assert nearest_resolution(1000, 1000, res) == (960, 960)
    samples = [Sample("a.mp4", "x", "video"), Sample("b.png", "x", "image"), Sample("c.mp4", "x", "video")]
    shapes = bucket_shapes(samples, 17, 704, 1280, res, [(1080, 1920), (1920, 1080), None])
    assert shapes == [(17, 1280, 704), (1, 704, 1280), (17, 704, 1280)]  # unknown size: the default resolution
    assert bucket_shapes(samples, 17, 704, 1280) == [(17, 704, 1280), (1, 704, 1280), (17, 704, 1280)]
