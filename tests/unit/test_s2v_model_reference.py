"""WanS2VTransformer computes what DiffSynth-Studio's Wan2.2-S2V model computes (``diffsynth`` 2.1.12,
``diffsynth/models/wan_video_dit_s2v.py``, which loads the original release's state dict as is): same weights through
the original key names, fp32, with and without motion frames and pose; and its FramePack motion tokens and rotary
positions in every packing mode.

The reference needs ``diffsynth`` and ``einops`` importable (diffsynth's other dependencies are not used: only its
model files are loaded, without running ``diffsynth/__init__.py``). Install them outside the project's environment and
name the folders::

    pip install --no-deps --target REF/diffsynth diffsynth==2.1.12
    pip install --no-deps --target REF/einops einops
    WANEXP_S2V_REFERENCE=REF/diffsynth:REF/einops pytest tests/unit/test_s2v_model_reference.py

Skipped when the reference cannot be imported.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.unit.test_s2v_model import inputs
from wanexp.models.s2v import build, original
from wanexp.models.s2v.transformer import FramePackMotioner, WanS2VTransformer, rotary_tables

TOL = 1e-5


def _reference():
    """diffsynth.models.wan_video_dit_s2v from the folders in WANEXP_S2V_REFERENCE, or a skip reason."""
    paths = [p for p in os.environ.get("WANEXP_S2V_REFERENCE", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        spec = importlib.util.find_spec("diffsynth")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(next(iter(spec.submodule_search_locations)))
        # empty parent packages: diffsynth/__init__.py imports the whole library and its dependencies
        for name, path in (("diffsynth", root), ("diffsynth.core", root / "core")):
            if name not in sys.modules:
                pkg = types.ModuleType(name)
                pkg.__path__ = [str(path)]
                sys.modules[name] = pkg
        return importlib.import_module("diffsynth.models.wan_video_dit_s2v")
    except ImportError:
        return None


REF = _reference()
pytestmark = pytest.mark.skipif(
    REF is None, reason="the reference is not importable: pip install --no-deps --target REF/diffsynth "
                        "diffsynth==2.1.12 and --target REF/einops einops, then WANEXP_S2V_REFERENCE=REF/diffsynth:"
                        "REF/einops (see this file's doc)")


def reference_model(model):
    """DiffSynth's WanS2VModel at ``model``'s config holding its weights (through the original key names)."""
    c = model.config
    ref = REF.WanS2VModel(
        dim=c.dim, in_dim=c.in_dim, ffn_dim=c.ffn_dim, out_dim=c.out_dim, text_dim=c.text_dim, freq_dim=c.freq_dim,
        eps=c.eps, patch_size=tuple(c.patch_size), num_heads=c.num_heads, num_layers=c.num_layers,
        cond_dim=c.cond_dim, audio_dim=c.audio_dim, num_audio_token=c.num_audio_token,
        enable_adain=c.enable_adain, audio_inject_layers=list(c.audio_inject_layers),
        zero_timestep=c.zero_timestep, framepack_drop_mode=c.framepack_drop_mode)
    names = original.original_key_map(model)
    ref.load_state_dict({names[k]: v for k, v in model.state_dict().items()}, strict=True)
    return ref.eval()


@pytest.fixture(scope="module")
def pair():
    model = build.randomize_(WanS2VTransformer(**build.tiny_config()), seed=3).eval()
    return model, reference_model(model)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("motion", ["kept", "dropped"])
@pytest.mark.parametrize("pose", [True, False])
def test_forward_matches_diffsynth(pair, motion, pose):
    """DiffSynth's forward takes [reference latent | noisy latents] along frames and returns the reference frame
    back in front; its ``inject_motion`` receives the motion-drop flag its pipeline passes (drop_motion_frames)."""
    model, ref = pair
    x = inputs(model, frames=3, size=16)
    drop = motion == "dropped"
    inject = type(ref).inject_motion
    ref.inject_motion = lambda *a, **k: inject(ref, *a, **{**k, "drop_motion_frames": drop})
    pose_latents = x["pose_latents"] if pose else None
    with torch.no_grad():
        expected = ref(torch.cat([x["ref_latents"], x["hidden_states"]], dim=2), x["timestep"],
                       x["encoder_hidden_states"], x["audio_features"], x["motion_latents"], pose_latents)[:, :, 1:]
        out = model(**{**x, "pose_latents": pose_latents, "motion_latents": None if drop else x["motion_latents"]})
    assert out.shape == x["hidden_states"].shape
    assert relative_error(out, expected) <= TOL


def test_the_real_size_key_set_is_diffsynths():
    """DiffSynth builds the released config (its defaults) with exactly the original keys our model maps to."""
    with torch.device("meta"):
        ours = WanS2VTransformer(**build.real_config())
        c = ours.config
        ref = REF.WanS2VModel(dim=c.dim, in_dim=c.in_dim, ffn_dim=c.ffn_dim, out_dim=c.out_dim, text_dim=c.text_dim,
                              freq_dim=c.freq_dim, eps=c.eps, patch_size=tuple(c.patch_size), num_heads=c.num_heads,
                              num_layers=c.num_layers, cond_dim=c.cond_dim, audio_dim=c.audio_dim,
                              num_audio_token=c.num_audio_token)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    names = original.original_key_map(ours)
    assert {names[k]: tuple(v.shape) for k, v in ours.state_dict().items()} == ref_shapes


@pytest.mark.parametrize("drop_mode", ["padd", "drop"])
@pytest.mark.parametrize("add_last_motion", [0, 1, 2])
@pytest.mark.parametrize("motion_frames", [19, 5])
def test_framepack_tokens_and_positions_match(drop_mode, add_last_motion, motion_frames):
    """FramePack in every mode, with a full and a short motion history: the same tokens, and rotary tables equal to
    the reference's complex factors."""
    dim, heads = 64, 2
    ours = FramePackMotioner(16, dim, drop_mode)
    theirs = REF.FramePackMotioner(inner_dim=dim, num_heads=heads, drop_mode=drop_mode)
    theirs.load_state_dict(build.randomize_(ours, seed=5).state_dict())
    latents = torch.randn(1, 16, motion_frames, 16, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tokens, positions = ours(latents, add_last_motion)
        (ref_tokens,), (ref_rope,) = theirs([latents[0]], add_last_motion)
    torch.testing.assert_close(tokens, ref_tokens, rtol=TOL, atol=1e-6)
    cos, sin = rotary_tables(positions, dim // heads, "cpu")
    factor = ref_rope[0, :, 0]  # (tokens, head_dim / 2) complex
    assert cos.shape[1] == factor.shape[0] == tokens.shape[1]
    torch.testing.assert_close(cos[0, :, 0, 0::2], factor.real.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, :, 0, 1::2], factor.imag.float(), rtol=0, atol=1e-6)
