"""Other trainers' dataset files (musubi-tuner and diffusion-pipe TOML, ai-toolkit YAML) read as data.datasets, directly
(``data.datasets=FILE``) or converted into a data group (``python -m wanexp.cli.dataset convert``); what cannot be
mapped is named in one line, an unreadable file is one line."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import compose_cfg
from wanexp.config.dataset_files import read_dataset_file
from wanexp.data.datamodule import parse_datasets
from wanexp.errors import ConfigError

# musubi-tuner's docs/dataset_config.md samples, combined: an image folder, a video folder with several target frame
# counts, a video JSONL file with uniform windows, general settings with bucketing.
MUSUBI = """
[general]
resolution = [960, 544]
caption_extension = ".caption"
batch_size = 2
enable_bucket = true
bucket_no_upscale = false

[[datasets]]
image_directory = "/data/images"
cache_directory = "/data/cache/images"
num_repeats = 3

[[datasets]]
video_directory = "/data/videos"
cache_directory = "/data/cache/videos"
target_frames = [1, 25, 45]
frame_extraction = "head"
source_fps = 30.0

[[datasets]]
video_jsonl_file = "meta/clips.jsonl"
cache_directory = "/data/cache/jsonl"
target_frames = [33]
frame_extraction = "uniform"
frame_sample = 4
resolution = [832, 480]
enable_bucket = false
"""
SEVEN = [[544, 960], [576, 896], [640, 832], [736, 736], [832, 640], [896, 576], [960, 544]]  # 960x544's area

# diffusion-pipe's examples/dataset.toml, filled in: AR buckets by range, frame buckets, a per-directory override.
PIPE = """
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 3
frame_buckets = [1, 33, 65]
caption_prefix = "in the style of x, "
cache_shuffle_num = 10

[[directory]]
path = '/home/anon/data/videos'
num_repeats = 5
mask_path = '/home/anon/data/masks'

[[directory]]
path = 'stills'
resolutions = [[1280, 720], 256]
enable_ar_bucket = false
"""

# ai-toolkit's config/examples/train_lora_wan22_14b_24gb.yaml, its datasets part (and a second, image dataset).
AI_TOOLKIT = """
job: extension
config:
  name: my_first_wan22_14b_lora_v1
  process:
    - type: sd_trainer
      training_folder: output
      network: {type: lora, linear: 32, linear_alpha: 32}
      datasets:
        - folder_path: /path/to/clips
          caption_ext: txt
          caption_dropout_rate: 0.05
          num_frames: 33
          resolution: [512, 768]
          cache_latents_to_disk: true
        - folder_path: /path/to/photos
          caption_ext: .caption
          caption_dropout_rate: 0.05
          num_repeats: 2
          resolution: 512
          buckets: false
          trigger_word: p3r5on
          flip_x: true
      train:
        batch_size: 2
        steps: 2000
"""


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_musubi_tuner_toml_maps_to_datasets(tmp_path):
    found = read_dataset_file(_file(tmp_path, "dataset.toml", MUSUBI), cwd=tmp_path)
    video = {"metadata": "/data/videos", "repeat": 1, "window": "first", "buckets": SEVEN,
             "caption_extension": ".caption"}
    assert found.kind == "musubi-tuner" and found.group == {"batch_size": 2}
    assert found.datasets == {
        "images": {"metadata": "/data/images", "repeat": 3, "buckets": SEVEN, "caption_extension": ".caption"},
        # one entry per target frame count: musubi trains each clip at each of them
        "videos_1f": {**video, "num_frames": 1}, "videos_25f": {**video, "num_frames": 25},
        "videos_45f": {**video, "num_frames": 45},
        # a JSONL file's relative path is taken from the current folder, as musubi-tuner takes it
        "clips": {"metadata": str(tmp_path / "meta" / "clips.jsonl"), "repeat": 1, "num_frames": 33,
                  "window": "uniform", "windows_per_clip": 4, "height": 480, "width": 832},
    }
    assert found.warning == (
        f"{tmp_path / 'dataset.toml'} (musubi-tuner): not mapped: bucket_no_upscale, cache_directory (wanexp keeps "
        "one cache, data.cache_dir, keyed by content); approximated: enable_bucket: data.buckets of 7 aspect ratios "
        "(16:9 to 9:16) of 960x544's area")


@pytest.mark.parametrize("how, extra, frames, note", [
    ("chunk", "", {"num_frames": 25, "window": "chunks", "windows_per_clip": 0}, None),
    ("slide", "frame_stride = 10\n", {"num_frames": 25, "window": "chunks", "windows_per_clip": 0},
     "frame_extraction=slide (frame_stride=10): window=chunks (consecutive windows; wanexp has no sliding start)"),
    ("full", "max_frames = 47\n", {"num_frames": 45, "window": "first"},
     "frame_extraction=full: every clip at max_frames=45 frames (shorter clips are rejected, not trimmed)"),
])
def test_musubi_frame_extraction_maps_to_windows(tmp_path, how, extra, frames, note):
    text = f"[[datasets]]\nvideo_directory = '/v'\ntarget_frames = [25]\nframe_extraction = '{how}'\n{extra}"
    found = read_dataset_file(_file(tmp_path, "d.toml", text), cwd=tmp_path)
    # musubi-tuner's defaults: resolution [960, 544] (width, height), .txt captions, one repeat, no buckets
    assert found.datasets == {"v": {"metadata": "/v", "repeat": 1, **frames, "height": 544, "width": 960,
                                    "caption_extension": ".txt"}}
    assert found.approximated == ([note] if note else []) and found.ignored == []


def test_a_diffusion_pipe_toml_maps_to_datasets(tmp_path):
    found = read_dataset_file(_file(tmp_path, "dataset.toml", PIPE), cwd=tmp_path)
    prefix = {"caption_extension": ".txt", "caption_prefix": "in the style of x, "}
    assert found.kind == "diffusion-pipe" and found.group == {}
    assert found.datasets == {
        # width/height ratios 0.5, 1, 2 of 512x512's area; videos at the shortest video frame bucket
        "videos": {"metadata": "/home/anon/data/videos", "repeat": 5, "num_frames": 33,
                   "buckets": [[736, 352], [512, 512], [352, 736]], **prefix},
        # no AR buckets: square, of each resolution's area; one entry per resolution (each clip trains at both)
        "stills_1280x720": {"metadata": str(tmp_path / "stills"), "repeat": 1, "num_frames": 33, "height": 960,
                            "width": 960, **prefix},
        "stills_256": {"metadata": str(tmp_path / "stills"), "repeat": 1, "num_frames": 33, "height": 256,
                       "width": 256, **prefix},
    }
    assert found.ignored == ["cache_shuffle_num", "mask_path"]
    assert found.approximated == ["frame_buckets [33, 65]: every clip at 33 frames (one frame count per dataset; "
                                  "longer buckets not used)"]


def test_an_ai_toolkit_config_maps_to_datasets(tmp_path):
    found = read_dataset_file(_file(tmp_path, "train_lora.yaml", AI_TOOLKIT), cwd=tmp_path)
    clips = {"metadata": "/path/to/clips", "repeat": 1, "num_frames": 33, "caption_extension": ".txt"}
    assert found.kind == "ai-toolkit" and found.group == {"batch_size": 2, "caption_dropout": 0.05}
    assert found.datasets == {
        "clips_512": {**clips, "buckets": [[384, 672], [416, 640], [448, 576], [512, 512], [576, 448], [640, 416],
                                           [672, 384]]},
        "clips_768": {**clips, "buckets": [[576, 1024], [640, 928], [672, 896], [768, 768], [896, 672], [928, 640],
                                           [1024, 576]]},
        "photos": {"metadata": "/path/to/photos", "repeat": 2, "num_frames": 1, "height": 512, "width": 512,
                   "caption_extension": ".caption", "caption_prefix": "p3r5on, "},
    }
    assert found.ignored == ["cache_latents_to_disk", "flip_x"]
    assert [a.split(":")[0] for a in found.approximated] == ["shrink_video_to_frames", "buckets", "trigger_word"]


def test_data_datasets_file_in_a_commands_own_entry(tmp_path, monkeypatch, capsys):
    """hydra_main (train.py, wanexp-cache, wanexp-plan): the file read before the command runs, its warning printed;
    a bad file is one line, exit 2, before the command runs."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from wanexp.composition import hydra_main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # hydra_main sets it: restored to unset after the test
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    seen = []
    path = _file(tmp_path, "dataset.toml", MUSUBI)
    for file in (path, _file(tmp_path, "bad.toml", "[[datasets]\n")):
        monkeypatch.setattr(sys, "argv", ["train.py", "experiment=demo", f"data.datasets={file}"])
        try:
            hydra_main(seen.append)
        except SystemExit as e:
            seen.append(e.code)
        finally:
            GlobalHydra.instance().clear()
    assert OmegaConf_container(seen[0].data.datasets) == read_dataset_file(path).datasets and seen[1] == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"wanexp: warning: {path} (musubi-tuner): not mapped: bucket_no_upscale, cache_directory")
    assert err.startswith(f"wanexp: error: {tmp_path / 'bad.toml'}: not valid TOML (") and err.count("\n") == 1


@pytest.mark.parametrize("text", [MUSUBI, PIPE])
def test_every_mapped_entry_is_one_the_datamodule_takes(tmp_path, text):
    found = read_dataset_file(_file(tmp_path, "d.toml", text), cwd=tmp_path)
    top = {"metadata": None, "root": None, "repeat": 1, "num_frames": 17, "height": 704, "width": 1280,
           "buckets": None, "fps": None, "frame_stride": 1, "window": "first", "windows_per_clip": 1,
           "caption_prefix": "", "caption_extension": ".txt"}
    parts = parse_datasets(found.datasets, top, (4, 1))
    assert [p.name for p in parts] == list(found.datasets)
    assert {p.caption_extension for p in parts} <= {".txt", ".caption"}


def test_data_datasets_names_a_file_read_when_the_config_composes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _file(tmp_path, "my_lora.yaml", AI_TOOLKIT)
    cfg = compose_cfg(["experiment=demo", f"data.datasets={path}", "data.batch_size=3"])
    assert OmegaConf_container(cfg.data.datasets) == read_dataset_file(path).datasets
    # the file's caption dropout is the group's; the command line's batch size wins over the file's 2
    assert (cfg.data.caption_dropout, cfg.data.batch_size, cfg.data.name) == (0.05, 3, "my_lora")
    assert cfg.data.cache_dir.endswith("/my_lora")


def OmegaConf_container(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def test_convert_writes_a_data_group_the_run_composes(tmp_path, monkeypatch, capsys):
    from wanexp.cli.dataset import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANEXP_CONFIG_DIR", raising=False)
    out = main(["convert", str(_file(tmp_path, "dataset.toml", MUSUBI)), "--name", "my_data"])
    assert out == tmp_path / "conf" / "data" / "my_data.yaml"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("wanexp: warning: ") and "not mapped: bucket_no_upscale, cache_directory" in printed[0]
    text = out.read_text()
    assert "# Not mapped: bucket_no_upscale, cache_directory" in text and "&id" not in text  # no YAML anchors
    cfg = compose_cfg(["data=my_data", "model.path=/m"])  # ./conf is on the search path
    assert OmegaConf_container(cfg.data.datasets) == read_dataset_file(tmp_path / "dataset.toml").datasets
    assert (cfg.data.batch_size, cfg.data.name) == (2, "my_data")
    with pytest.raises(SystemExit) as stop:  # an existing group is not replaced without --force
        main(["convert", str(tmp_path / "dataset.toml"), "--name", "my_data"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"wanexp: error: {out}: already exists; pass --force to replace it, or another --name\n")


@pytest.mark.parametrize("name, text, says", [
    ("bad.toml", "[general\nresolution = [960, 544]\n", r"bad.toml: not valid TOML \(.*\); fix the syntax"),
    ("bad.yaml", "datasets:\n  - folder_path: [\n", r"bad.yaml: not valid YAML \(.*\); fix the syntax"),
    ("other.toml", "[model]\ntype = 'wan'\n", r"other.toml: neither a musubi-tuner dataset file \(\[\[datasets\]\]\) "
                                              r"nor a diffusion-pipe one \(\[\[directory\]\]\)$"),
    ("main.toml", "output_dir = '/x'\ndataset = 'examples/dataset.toml'\n",
     r"looks like diffusion-pipe's training config: pass the dataset file it names \(dataset = 'examples/"),
    ("reps.toml", "[[datasets]]\nvideo_directory = '/v'\nnum_repeats = 'two'\n",
     r"reps.toml: datasets\[0\].num_repeats='two': must be an integer$"),
    ("two.toml", "[[datasets]]\nvideo_directory = '/v'\nimage_directory = '/i'\n",
     r"datasets\[0\]: needs exactly one of video_directory, .* \(found video_directory, image_directory\)"),
    ("fx.toml", "[[datasets]]\nvideo_directory = '/v'\nframe_extraction = 'middle'\n",
     r"frame_extraction='middle': one of head, chunk, slide, uniform, full"),
    ("nopath.toml", "resolutions = [512]\n[[directory]]\nnum_repeats = 2\n", r"directory\[0\]: no path; set path"),
    ("list.yaml", "- caption_ext: txt\n", r"list.yaml: datasets\[0\]: no folder_path"),
    ("data.ini", "[x]\n", r"data.ini: unknown dataset file type '.ini'"),
])
def test_a_file_that_cannot_be_read_or_mapped_is_one_line(tmp_path, name, text, says):
    with pytest.raises(ConfigError) as e:
        read_dataset_file(_file(tmp_path, name, text), cwd=tmp_path)
    assert re.search(says, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_a_bad_file_stops_the_command_with_one_line_and_exit_2(tmp_path, capsys):
    from wanexp.cli.dataset import main

    with pytest.raises(SystemExit) as stop:
        main(["convert", str(_file(tmp_path, "d.toml", "[[datasets]\n")), "--conf-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"wanexp: error: {tmp_path / 'd.toml'}: not valid TOML (")
    assert err.count("\n") == 1 and not (tmp_path / "c").exists()  # nothing written
    with pytest.raises(SystemExit) as stop:
        main(["convert", str(tmp_path / "missing.toml")])
    assert stop.value.code == 2 and "missing.toml: dataset file not found" in capsys.readouterr().err


def test_the_musubi_jsonl_columns_read_as_media_and_caption(tmp_path):
    from wanexp.data.metadata import read_metadata_with_rejects

    (tmp_path / "a.mp4").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    meta = _file(tmp_path, "m.jsonl", '{"video_path": "a.mp4", "caption": "a cat"}\n'
                                      '{"image_path": "b.png", "caption": "a dog"}\n')
    samples, rejects = read_metadata_with_rejects(meta)
    assert [(Path(s.path).name, s.prompt, s.kind) for s in samples] == [("a.mp4", "a cat", "video"),
                                                                        ("b.png", "a dog", "image")]
    assert not rejects


def test_yaml_of_the_conversion_is_plain(tmp_path):
    """The written group reads back as the same mapping (no Python tags, lists inline)."""
    from wanexp.cli.dataset import main

    out = main(["convert", str(_file(tmp_path, "dataset.toml", PIPE)), "--conf-dir", str(tmp_path / "c")])
    written = yaml.safe_load(out.read_text())
    assert written["defaults"] == ["mbc_5k", "_self_"] and written["name"] == "dataset"
    assert written["datasets"] == read_dataset_file(tmp_path / "dataset.toml").datasets


@pytest.mark.slow
def test_the_cache_encodes_a_converted_diffusion_pipe_folder(shared_dir, tmp_path, monkeypatch):
    """End to end: a diffusion-pipe dataset TOML naming a folder of clips with .txt captions, converted into the
    user's conf/, cached by the cache command's builder at the entry's shape and repeat."""
    from wanexp.cli.cache import build_cache
    from wanexp.cli.dataset import main
    from wanexp.data.metadata import read_metadata
    from wanexp.data.synthetic import make_demo_dataset

    gen = make_demo_dataset(tmp_path / "gen", num_videos=2, num_images=1, num_frames=9, height=64, width=96)
    clips = tmp_path / "clips"
    clips.mkdir()
    for i, s in enumerate(read_metadata(gen)):
        (clips / f"c{i}{Path(s.path).suffix}").write_bytes(Path(s.path).read_bytes())
        (clips / f"c{i}.txt").write_text(s.prompt)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANEXP_CONFIG_DIR", raising=False)
    _file(tmp_path, "dataset.toml", "resolutions = [[96, 64]]\nenable_ar_bucket = true\nar_buckets = [1.5]\n"
                                    "frame_buckets = [1, 9]\n[[directory]]\npath = 'clips'\nnum_repeats = 2\n")
    main(["convert", "dataset.toml", "--name", "pipe_clips"])
    stats = build_cache(compose_cfg(["experiment=demo", "data=pipe_clips", f"paths.tiny_model_dir={shared_dir}/models",
                                     f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0"]))
    assert stats["latents"] == 3 and stats["texts"] == 3  # each clip and image once (repeats share an entry)
