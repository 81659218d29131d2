"""The S2V family end to end on the CPU (model=tiny_s2v, the release folder's layout at tiny sizes): clips with
audio -> wanexp.cli.cache (latents, reference latents and wav2vec2 features; a clip without audio rejected with its
reason) -> python train.py, SIGKILLed after a checkpoint -> resume=auto to the LoRA of an uninterrupted run, bit for
bit -> the LoRA files (ComfyUI's with the original S2V names, the audio injector's included; the diffusers file loads
back into the DiT) -> wanexp-sample with a speech file, on one process and two (CFG parallel) -> an mp4 with an audio
stream."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FPS = 16


def _tone(hz: float, seconds: float, rate: int = 16000) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _frames(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, size=(1, 8, 8, 3))
    frames = np.repeat(np.repeat(base, 6, axis=1), 6, axis=2).repeat(n, axis=0)
    return np.clip(frames + np.arange(n)[:, None, None, None] * 4, 0, 255).astype(np.uint8)


def _write_wav(path, samples: np.ndarray, rate: int = 16000) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray((samples * 32767).astype(np.int16)[None], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


@pytest.fixture
def clips(tmp_path):
    """Four clips with audio (their own track x2, a same-name .wav, an audio_path column) and one without any."""
    from wanexp.data.media import write_video

    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i in range(2):
        write_video(data / f"talk{i}.mp4", _frames(12, i), FPS, audio=(_tone(300 + 100 * i, 1.0), 16000))
        rows.append({"video": f"talk{i}.mp4", "prompt": f"a person talking {i}", "audio_path": ""})
    write_video(data / "side.mp4", _frames(12, 5), FPS)
    _write_wav(data / "side.wav", _tone(700, 1.0))
    rows.append({"video": "side.mp4", "prompt": "a person singing", "audio_path": ""})
    write_video(data / "column.mp4", _frames(12, 6), FPS)
    _write_wav(data / "speech.wav", _tone(500, 1.0))
    rows.append({"video": "column.mp4", "prompt": "a person speaking", "audio_path": "speech.wav"})
    write_video(data / "mute.mp4", _frames(12, 7), FPS)
    rows.append({"video": "mute.mp4", "prompt": "a silent person", "audio_path": ""})
    with (data / "metadata.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt", "audio_path"])
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def _overrides(root, *extra) -> list[str]:
    return ["experiment=demo", "model=tiny_s2v", f"paths.tiny_model_dir={root}/models",
            f"paths.output_dir={root}/run", f"data.cache_dir={root}/cache", f"data.metadata={root}/data/metadata.csv",
            "data.generate=null", "data.num_frames=9", "data.height=32", "data.width=32",
            "data.max_reject_fraction=0.5",
            "adapter.rank=4", "adapter.alpha=2", "optim.lr=1e-2",
            "optim.warmup_steps=0", "optim.scheduler=constant", "trainer.log_every_n_steps=1",
            "callbacks.progress=null",
            "callbacks.checkpoint.every_n_train_steps=2", "callbacks.validation=null", *extra]


def _command(monkeypatch, capsys, main, argv: list[str]) -> str:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    main()
    out = capsys.readouterr()
    return out.out + out.err


def _lora(checkpoint):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["global_step"], {k: v for k, v in state["state_dict"].items() if ".lora_" in k}


def test_s2v_caches_trains_resumes_exports_and_samples_with_audio(clips, monkeypatch, capsys):
    from hydra.utils import instantiate

    from tests.conftest import compose_cfg
    from wanexp.cli import cache
    from wanexp.data.cache import CacheIndex
    from wanexp.train import main as train

    root, run = clips, clips / "run"
    # 1. the cache: x0, the reference latent and the audio features of each clip with audio; the mute clip rejected
    out = _command(monkeypatch, capsys, cache.main, ["wanexp-cache", *_overrides(root)])
    index = CacheIndex(root / "cache")
    latents = {e["media"]: e["key"] for e in index.entries.values() if e["kind"] == "latent"}
    assert sorted(latents) == sorted(str(root / "data" / f"{n}.mp4") for n in ("talk0", "talk1", "side", "column"))
    rejects = [json.loads(x) for f in sorted((root / "cache").glob("rejects*.jsonl"))
               for x in f.read_text().splitlines()]
    assert [r["path"] for r in rejects] == [str(root / "data" / "mute.mp4")], out
    assert "no audio stream and no mute.wav" in rejects[0]["reason"]
    spec = instantiate(compose_cfg(_overrides(root)).model, _convert_="all")
    encoders = spec.load_encoders()
    for name, source in (("talk0", "talk0.mp4"), ("side", "side.wav"), ("column", "speech.wav")):
        stored = index.load(latents[str(root / "data" / f"{name}.mp4")])
        assert sorted(stored) == ["audio", "latents", "ref_latents"]
        assert stored["latents"].shape == (16, 2, 4, 4) and stored["ref_latents"].shape == (16, 1, 4, 4)
        samples = spec.load_sample_input("audio", str(root / "data" / source), 9, FPS)
        assert samples.shape == (9000,)  # the 9 frames' span at 16 kHz
        assert stored["audio"].shape == (3, 32, 8)  # wav2vec2's 3 layers, width 32, the 8 generated frames
        assert torch.equal(stored["audio"], encoders.encode_audio(samples[None], 9)[0])
    # the side .wav, not the (silent) video's own stream, is the side clip's audio (mute.mp4: rejected above)
    assert not torch.equal(index.load(latents[str(root / "data" / "side.mp4")])["audio"],
                           index.load(latents[str(root / "data" / "talk0.mp4")])["audio"])

    # 2. train from the cache in a process of its own, SIGKILLed after its step-2 checkpoint, then resume=auto here
    steps = 8
    log = root / "killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *_overrides(root, f"trainer.max_steps={steps}",
                                                                                   "resume=auto")],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if json.loads((run / "status.json").read_text()).get("step", 0) >= 3:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)
        assert proc.poll() is None, f"the run ended before the kill:\n{log.read_text()[-2000:]}"
        proc.kill()
        proc.wait()
    step, first = _lora(run / "checkpoints" / "last.ckpt")
    modules = {k.split(".lora_")[0].removeprefix("transformers.dense.") for k in first}
    assert 2 <= step < steps and {"blocks.0.audio_injector.attn.to_q", "blocks.4.audio_injector.attn.to_out.0",
                                  "blocks.1.attn1.to_q", "blocks.3.attn2.to_v", "blocks.2.ffn.net.2"} <= modules
    assert not any("blocks.1.audio_injector" in m for m in modules)  # block 1 has no audio injection
    out = _command(monkeypatch, capsys, train, ["train.py", *_overrides(root, f"trainer.max_steps={steps}",
                                                                        "resume=auto")])
    assert f"resume=auto: continuing from {run}/checkpoints/" in out
    step, last = _lora(run / "checkpoints" / "last.ckpt")
    assert step == steps and all(not torch.equal(first[k], last[k]) for k in first if ".lora_B." in k)
    # the resumed run's LoRA is bit-identical to an uninterrupted one's (audio dropout draws included)
    _command(monkeypatch, capsys, train, ["train.py", *_overrides(root, f"trainer.max_steps={steps}",
                                                                  f"paths.output_dir={root}/straight")])
    _, straight = _lora(root / "straight" / "checkpoints" / "last.ckpt")
    assert straight.keys() == last.keys() and all(torch.equal(straight[k], last[k]) for k in last)

    # 3. the LoRA files: ComfyUI's keys are the original S2V names; the diffusers file loads back as trained
    final = run / "lora" / "final"
    comfy = load_file(next(final.glob("*_comfyui.safetensors")))
    names = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] for k in comfy if not k.endswith(".alpha")}
    assert {"audio_injector.injector.0.q", "audio_injector.injector.1.o", "blocks.1.self_attn.q",
            "blocks.3.cross_attn.v", "blocks.2.ffn.2"} <= names
    assert not any(n.startswith("blocks.") and ".audio_injector" in n for n in names)
    transformer = spec.load_transformer("dense")
    transformer.load_lora_adapter(str(final), weight_name=next(final.glob("*_diffusers.safetensors")).name,
                                  prefix="transformer", adapter_name="back")
    loaded = {k: v for k, v in transformer.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(last)
    for key, value in loaded.items():
        assert torch.equal(value, last["transformers.dense." + key.replace(".back.", ".default.")]), key

    # 4. wanexp-sample --run with a speech file (the run's LoRA): 12 frames are two clips of 12 (the first keeps 9;
    # the 1 s of audio gives 2), the second conditioned on the first's frames; an mp4 with the audio muxed in
    from wanexp.cli import sample

    speech = root / "data" / "speech.wav"
    args = ["--run", str(run), "--prompt", "a person speaking", "--audio", str(speech), "--height", "64", "--width",
            "64", "--frames", "12", "--steps", "2", "--guidance", "4.5", "--device", "cpu", "--save-latents"]
    res = sample.main([*args, "--out", str(root / "one")])
    (entry,) = res["samples"]
    # 64 x 64: the motion frames' 4x-packed part needs 8 x 8 latents
    assert entry["latents"].shape == (1, 16, 6, 8, 8) and len(entry["timesteps"]) == 4
    assert entry["audio"] == str(speech) and res["loras"]
    with av.open(entry["file"]) as f:
        assert len(f.streams.video) == 1 and len(f.streams.audio) == 1
        assert sum(1 for _ in f.decode(video=0)) == 12
    # the same sample on two processes, each running one half of every CFG pair (prompt + audio / negative + silence)
    done = subprocess.run([sys.executable, "-m", "wanexp.cli.sample", *args, "--gpus", "2", "--cfg-parallel", "--out",
                           str(root / "two")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(load_file(str(root / "two" / "p0_s0_latents.safetensors"))["latents"], entry["latents"])
    two = json.loads((root / "two" / "metrics.json").read_text())["processes"]
    assert two["block_calls"] * 2 == res["processes"]["block_calls"]
    # and with the sequence split over two processes (Ulysses over noisy, reference and motion tokens)
    done = subprocess.run([sys.executable, "-m", "wanexp.cli.sample", *args, "--gpus", "2", "--sp", "2", "--out",
                           str(root / "sp")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(load_file(str(root / "sp" / "p0_s0_latents.safetensors"))["latents"],
                               entry["latents"], rtol=1e-4, atol=1e-5)
    sp = json.loads((root / "sp" / "metrics.json").read_text())["processes"]
    assert (sp["sp"], sp["cfg"]) == (2, 1) and sp["block_tokens"] == -(-res["processes"]["block_tokens"] // 2)
    # a clip as the audio (validation hands over a held-out clip's path) is heard as training hears it: the silent
    # side.mp4 through its same-name side.wav
    heard = {}
    for name in ("side.mp4", "side.wav"):
        swapped = [str(root / "data" / name) if a == str(speech) else a for a in args]
        heard[name] = sample.main([*swapped, "--out", str(root / name)])["samples"][0]["latents"]
    assert torch.equal(heard["side.mp4"], heard["side.wav"]) and not torch.equal(heard["side.wav"], entry["latents"])


def test_s2v_trains_with_block_swap_fp8_storage_ddp_and_fsdp(clips, monkeypatch, capsys):
    """The memory options and the strategies apply to the S2V DiT as to Wan's: block swap (2 of its 5 blocks) and
    offloaded activations give the plain run's LoRA exactly, FP8 storage trains with finite losses, and DDP and FSDP2
    on 2 CPU processes train on the same samples with the same losses (up to the rounding of their gradient sums)."""
    from wanexp.cli import cache
    from wanexp.train import main as train

    root = clips
    _command(monkeypatch, capsys, cache.main, ["wanexp-cache", *_overrides(root)])

    def trained(name, *extra):
        out = _command(monkeypatch, capsys, train, ["train.py", *_overrides(root, "trainer.max_steps=2",
                                                                            f"paths.output_dir={root}/{name}", *extra)])
        return out, load_file(next((root / name / "lora" / "final").glob("*_diffusers.safetensors")))

    _, plain = trained("plain")
    out, swapped = trained("swap", "model.blocks_to_swap=2")
    assert "model.blocks_to_swap=2: the frozen weights of 2 of 5 blocks" in out
    assert plain.keys() == swapped.keys() and all(torch.equal(plain[k], swapped[k]) for k in plain)
    # every block checkpointed with its input waiting in host memory: the same function
    _, offloaded = trained("offload", "model.gradient_checkpointing=true", "model.offload_activations=true")
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    out, fp8 = trained("fp8", "model.fp8_storage=true")
    assert "frozen linears of the dense transformer stored in FP8" in out
    assert all(torch.isfinite(v).all() for v in fp8.values())
    files = {}
    for strategy in ("ddp", "fsdp"):
        done = subprocess.run([sys.executable, str(ROOT / "train.py"), *_overrides(
            root, "trainer.max_steps=2", f"paths.output_dir={root}/{strategy}", f"parallel={strategy}",
            "trainer.accelerator=cpu", "trainer.devices=2", "parallel.strategy.timeout_s=120",
            *(["parallel.strategy.param_dtype=fp32"] if strategy == "fsdp" else []))],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        files[strategy] = load_file(next((root / strategy / "lora" / "final").glob("*_diffusers.safetensors")))
    ddp, fsdp = files["ddp"], files["fsdp"]
    assert ddp.keys() == fsdp.keys() == plain.keys()
    losses = {k: [json.loads(x)["loss"] for x in (root / k / "status.jsonl").read_text().splitlines()]
              for k in ("ddp", "fsdp")}
    # the same samples through the same weights at step 1; after one AdamW step the two gradient reductions' rounding
    # (all-reduce against reduce-scatter) shows, amplified where a gradient is near zero
    assert losses["ddp"][0] == pytest.approx(losses["fsdp"][0], rel=1e-6)
    assert losses["ddp"][1] == pytest.approx(losses["fsdp"][1], rel=1e-3)
    assert any(not torch.equal(ddp[k], plain[k]) for k in ddp)  # two ranks: twice the samples per step
