"""Clips with their pose and face videos for the real-size Animate case (device machine): N clips of F frames at HxW
and 30 fps (the model's rate), for each a pose video of the same size and frames and a 512x512 face video, a
metadata.csv (video, prompt, pose_video, face_video) and ref.png (a reference image for wanexp-sample --image).

    python tests/gpu/animate_clips.py DIR --clips 2 --frames 77 --height 480 --width 832
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

FPS = 30
FACE = 512


def moving(frames: int, height: int, width: int, seed: int, block: int = 16) -> np.ndarray:
    """(F, H, W, 3) uint8: a random block pattern brightening frame by frame (something the VAE encodes)."""
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, size=(1, height // block, width // block, 3))
    out = np.repeat(np.repeat(base, block, axis=1), block, axis=2).repeat(frames, axis=0)
    return np.clip(out + np.arange(frames)[:, None, None, None], 0, 255).astype(np.uint8)


def main() -> None:
    from PIL import Image

    from wanexp.data.media import write_video

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=77)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    a = ap.parse_args()
    a.folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(a.clips):
        write_video(a.folder / f"dance{i}.mp4", moving(a.frames, a.height, a.width, i), FPS)
        write_video(a.folder / f"pose{i}.mp4", moving(a.frames, a.height, a.width, 10 + i), FPS)
        write_video(a.folder / f"face{i}.mp4", moving(a.frames, FACE, FACE, 20 + i), FPS)
        rows.append({"video": f"dance{i}.mp4", "prompt": f"a person dancing, take {i}", "pose_video": f"pose{i}.mp4",
                     "face_video": f"face{i}.mp4"})
    with (a.folder / "metadata.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    Image.fromarray(moving(1, a.height, a.width, 99)[0]).save(a.folder / "ref.png")
    print(f"wrote {a.clips} clips with pose and face videos and ref.png into {a.folder}")


if __name__ == "__main__":
    main()
