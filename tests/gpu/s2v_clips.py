"""Clips with speech-like audio for the real-size S2V cases (device machine): N clips of F frames at HxW and 16 fps,
each with its own audio track (a gliding tone), a metadata.csv (video, prompt), and ``speech.wav`` of S seconds for
wanexp-sample --audio.

    python tests/gpu/s2v_clips.py DIR --clips 2 --frames 81 --height 480 --width 832 --seconds 6
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np


def tone(seconds: float, hz: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    glide = hz * (1 + 0.3 * np.sin(2 * np.pi * 0.5 * t))
    return (0.4 * np.sin(2 * np.pi * np.cumsum(glide) / rate)).astype(np.float32)


def main() -> None:
    import av

    from wanexp.data.media import write_video

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    rows = []
    g = np.random.default_rng(0)
    for i in range(a.clips):
        base = g.integers(0, 255, size=(1, a.height // 16, a.width // 16, 3))
        frames = np.repeat(np.repeat(base, 16, axis=1), 16, axis=2).repeat(a.frames, axis=0)
        frames = np.clip(frames + np.arange(a.frames)[:, None, None, None], 0, 255).astype(np.uint8)
        write_video(a.folder / f"talk{i}.mp4", frames, 16, audio=(tone(a.frames / 16 + 0.5, 220 + 60 * i), 16000))
        rows.append({"video": f"talk{i}.mp4", "prompt": f"a person talking to the camera, take {i}"})
    with (a.folder / "metadata.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["video", "prompt"])
        w.writeheader()
        w.writerows(rows)
    samples = (tone(a.seconds, 180) * 32767).astype(np.int16)
    with av.open(str(a.folder / "speech.wav"), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    print(f"wrote {a.clips} clips and speech.wav into {a.folder}")


if __name__ == "__main__":
    main()
