"""Other trainers' dataset files as wanexp's ``data`` settings: musubi-tuner's and diffusion-pipe's dataset TOML and
ai-toolkit's ``datasets`` list (its job YAML/JSON, or the list alone).

``read_dataset_file(path)`` maps a file to ``data.datasets`` entries (name -> entry, the keys of
``wanexp.data.datamodule.PART_KEYS``) plus the data group's own keys the file sets (``batch_size``,
``caption_dropout``), and lists what it could not map (``ignored``) and what it mapped with a difference
(``approximated``); ``DatasetFile.warning`` is that as one line. A file that cannot be read is one ConfigError line.

Two ways in (docs/datasets.md): ``data.datasets=/path/dataset.toml`` reads the file when the config is composed
(:func:`apply_dataset_file`, which every command that composes a run calls), and ``python -m wanexp.cli.dataset
convert`` writes the same mapping as a data group YAML.

What maps to what (each tool's own defaults apply to keys a file leaves out):

=====================  ====================================================  =========================================
wanexp                 musubi-tuner ([general] + [[datasets]])               diffusion-pipe (top + [[directory]])
=====================  ====================================================  =========================================
metadata               video_directory / image_directory / *_jsonl_file      path
repeat                 num_repeats                                           num_repeats
height, width          resolution = [width, height]                          resolutions (a side or [w, h]), square
buckets                enable_bucket: 7 aspect ratios of the same area       enable_ar_bucket: ar_buckets, or min_ar..
                                                                             max_ar in num_ar_buckets; size_buckets
num_frames             target_frames (one entry per count); full: max_frames frame_buckets (the shortest video bucket)
window                 frame_extraction head/chunk/uniform (frame_sample)    --
caption_extension      caption_extension                                     (.txt)
caption_prefix         --                                                    caption_prefix
data.batch_size        batch_size                                            --
=====================  ====================================================  =========================================

ai-toolkit (``datasets:`` entries): folder_path / dataset_path -> metadata, caption_ext -> caption_extension,
num_repeats -> repeat, num_frames, resolution (a side, or a list: one entry each) -> height/width or, with
``buckets`` (its default), 7 aspect buckets of that area; trigger_word -> caption_prefix; caption_dropout_rate ->
data.caption_dropout; batch_size (or the job's train.batch_size) -> data.batch_size.

Several values where wanexp has one entry (musubi's target_frames, diffusion-pipe's resolutions, ai-toolkit's
resolution list) become one entry each, which is what those tools train: every clip at every size/length.
"""
from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from wanexp.errors import ConfigError

# Aspect ratios (width / height) of the buckets made for a tool that buckets by aspect without listing them
# (musubi-tuner's enable_bucket, ai-toolkit's buckets): landscape, square and portrait clips and photos.
COMMON_RATIOS = (16 / 9, 3 / 2, 4 / 3, 1.0, 3 / 4, 2 / 3, 9 / 16)
MULTIPLE = 32  # bucket sides are rounded to this: a multiple of every Wan2.2 layout's model.hw_multiple (16 or 32)
KINDS = ("musubi-tuner", "diffusion-pipe", "ai-toolkit")


@dataclass
class DatasetFile:
    """A dataset file read: ``datasets`` (name -> data.datasets entry), ``group`` (the data group's keys it sets),
    ``ignored`` (its keys wanexp has no use for) and ``approximated`` (mapped with a difference, each ``key: how``)."""

    path: Path
    kind: str
    datasets: dict[str, dict] = field(default_factory=dict)
    group: dict = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    approximated: list[str] = field(default_factory=list)

    @property
    def warning(self) -> str | None:
        """What did not map, as one line (None: everything did)."""
        parts = ([f"not mapped: {', '.join(self.ignored)}"] if self.ignored else []) + (
            [f"approximated: {'; '.join(self.approximated)}"] if self.approximated else [])
        return f"{self.path} ({self.kind}): {'; '.join(parts)}" if parts else None

    def _ignore(self, keys) -> None:
        self.ignored += [k for k in keys if k not in self.ignored]

    def _approximate(self, note: str) -> None:
        if note not in self.approximated:
            self.approximated.append(note)


# ---- reading -------------------------------------------------------------------------------------------------------
def _load(path: Path):
    """The file's document: TOML (tomllib), YAML or JSON; one line when it is none of them."""
    if not path.is_file():
        raise ConfigError(f"{path}: dataset file not found (relative paths are taken from {os.getcwd()})")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the dataset file ({getattr(e, 'strerror', None) or e})") from None
    if suffix == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({_first_line(e)}); fix the syntax") from None
    if suffix in (".yaml", ".yml", ".json"):
        import yaml

        try:
            return yaml.safe_load(text)  # JSON is YAML
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid {'JSON' if suffix == '.json' else 'YAML'} ({_first_line(e)}); fix "
                              "the syntax") from None
    raise ConfigError(f"{path}: unknown dataset file type {suffix or '(no extension)'!r}; a musubi-tuner or "
                      "diffusion-pipe dataset .toml, or an ai-toolkit config .yaml/.json")


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def read_dataset_file(path: str | os.PathLike, cwd: Path | None = None) -> DatasetFile:
    """The file's datasets as data.datasets entries; relative media paths in it are taken from ``cwd`` (the current
    folder), as musubi-tuner, diffusion-pipe and ai-toolkit take them. One line for a file that cannot be read or
    mapped (not found, bad syntax, no datasets, a value of the wrong type)."""
    path = Path(os.path.expanduser(str(path))).absolute()
    doc, base = _load(path), (cwd or Path.cwd()).absolute()
    if path.suffix.lower() == ".toml":
        if not isinstance(doc, dict) or not (isinstance(doc.get("datasets"), list) or
                                             isinstance(doc.get("directory"), list)):
            hint = (f"; it looks like diffusion-pipe's training config: pass the dataset file it names "
                    f"(dataset = {doc['dataset']!r})" if isinstance(doc, dict) and isinstance(doc.get("dataset"), str)
                    else "")
            raise ConfigError(f"{path}: neither a musubi-tuner dataset file ([[datasets]]) nor a diffusion-pipe one "
                              f"([[directory]]){hint}")
        if isinstance(doc.get("datasets"), list):
            return _musubi(path, doc, base)
        return _diffusion_pipe(path, doc, base)
    entries, train = _ai_toolkit_entries(path, doc)
    return _ai_toolkit(path, entries, train, base)


# ---- shared helpers ------------------------------------------------------------------------------------------------
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true or false"}


def _get(table: dict, key: str, kinds, where: str, default=None):
    """``table[key]`` held to ``kinds`` (true/false is no number), or ``default`` when absent; one line naming the
    key otherwise."""
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        raise ConfigError(f"{where}.{key}={value!r}: must be {' or '.join(_TYPE_WORDS[k] for k in _tuple(kinds))}")
    return value


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _positive(table: dict, key: str, where: str, default: int) -> int:
    value = _get(table, key, int, where, default)
    if value < 1:
        raise ConfigError(f"{where}.{key}={value}: must be an integer >= 1")
    return value


def _path(value: str, base: Path) -> str:
    p = Path(os.path.expanduser(value))
    return os.path.normpath(p if p.is_absolute() else base / p)


def _round(value: float) -> int:
    return max(MULTIPLE, int(round(value / MULTIPLE)) * MULTIPLE)


def area_shape(area: float, ratio: float) -> list[int]:
    """[height, width] of ``area`` pixels at aspect ``ratio`` (width / height), each rounded to ``MULTIPLE``."""
    width = math.sqrt(area * ratio)
    return [_round(area / width), _round(width)]


def area_buckets(area: float, ratios) -> list[list[int]]:
    """One [height, width] bucket per aspect ratio, of ``area`` pixels (rounded; duplicates dropped)."""
    out: list[list[int]] = []
    for r in ratios:
        shape = area_shape(area, r)
        if shape not in out:
            out.append(shape)
    return out


def _shape(entry: dict, shapes: list[list[int]]) -> None:
    """One shape: height and width; several: buckets."""
    if len(shapes) == 1:
        entry["height"], entry["width"] = shapes[0]
    else:
        entry["buckets"] = shapes


def _name(path: str, taken: dict) -> str:
    """An entry name from a path's last part (letters, digits, _ and -), unique among ``taken``."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(path).stem or Path(path).name).strip("_") or "dataset"
    name, n = stem, 2
    while name in taken:
        name, n = f"{stem}_{n}", n + 1
    return name


ENTRY_ORDER = ("metadata", "repeat", "num_frames", "window", "windows_per_clip", "fps", "height", "width", "buckets",
               "caption_extension", "caption_prefix")


def _add(out: DatasetFile, base_name: str, variants: list[tuple[str, dict]]) -> None:
    """Entries of one source dataset: one, or one per variant (suffix, entry) when it has several; each its own copy,
    its keys in one order."""
    for suffix, entry in variants:
        name = base_name if len(variants) == 1 else f"{base_name}_{suffix}"
        ordered = copy.deepcopy({**{k: entry[k] for k in ENTRY_ORDER if k in entry}, **entry})
        out.datasets[_name(name, out.datasets) if name in out.datasets else name] = ordered


def _one_group_value(out: DatasetFile, key: str, values: list, source: str) -> None:
    """A data group key that a file sets per dataset: the value when they agree, else the first one (noted)."""
    distinct = list(dict.fromkeys(values))
    if not distinct:
        return
    out.group[key] = distinct[0]
    if len(distinct) > 1:
        out._approximate(f"{source} differs per dataset ({', '.join(map(str, distinct))}): data.{key}="
                         f"{distinct[0]} for all")


# ---- musubi-tuner --------------------------------------------------------------------------------------------------
MUSUBI_SOURCES = ("video_directory", "image_directory", "video_jsonl_file", "image_jsonl_file")
MUSUBI_USED = {*MUSUBI_SOURCES, "resolution", "caption_extension", "batch_size", "num_repeats", "enable_bucket",
               "target_frames", "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps"}
MUSUBI_WHY = {"cache_directory": "wanexp keeps one cache, data.cache_dir, keyed by content"}


def _musubi(path: Path, doc: dict, base: Path) -> DatasetFile:
    out = DatasetFile(path, "musubi-tuner")
    general = doc.get("general") or {}
    if not isinstance(general, dict):
        raise ConfigError(f"{path}: [general] must be a table")
    out._ignore(k for k in doc if k not in ("general", "datasets"))
    batch: list[int] = []
    for i, ds in enumerate(doc["datasets"]):
        where = f"{path.name}: datasets[{i}]"
        if not isinstance(ds, dict):
            raise ConfigError(f"{where}: must be a table ([[datasets]])")
        d = {**general, **ds}
        sources = [k for k in MUSUBI_SOURCES if d.get(k)]
        if len(sources) != 1:
            raise ConfigError(f"{where}: needs exactly one of {', '.join(MUSUBI_SOURCES)} (found "
                              f"{', '.join(sources) or 'none'})")
        source = sources[0]
        folder = _path(_get(d, source, str, where), base)
        entry: dict = {"metadata": folder, "repeat": _positive(d, "num_repeats", where, 1)}
        if source.endswith("_directory"):
            entry["caption_extension"] = _get(d, "caption_extension", str, where, ".txt")
        res = _get(d, "resolution", (list, int), where, [960, 544])
        res = [res, res] if isinstance(res, int) else res
        if len(res) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in res):
            raise ConfigError(f"{where}.resolution={res!r}: must be [width, height]")
        if _get(d, "enable_bucket", bool, where, False):
            entry["buckets"] = area_buckets(res[0] * res[1], COMMON_RATIOS)
            out._approximate(f"enable_bucket: data.buckets of {len(entry['buckets'])} aspect ratios (16:9 to 9:16) "
                             f"of {res[0]}x{res[1]}'s area")
        else:
            entry["height"], entry["width"] = res[1], res[0]
        batch.append(_positive(d, "batch_size", where, 1))
        variants = [("", entry)]
        if source.startswith("video"):
            variants = _musubi_frames(out, d, entry, where)
        _add(out, _name(folder, {}), variants)
        out._ignore(f"{k} ({MUSUBI_WHY[k]})" if k in MUSUBI_WHY else k for k in d if k not in MUSUBI_USED)
    if not doc["datasets"]:
        raise ConfigError(f"{path}: [[datasets]] is empty; list at least one dataset")
    _one_group_value(out, "batch_size", batch, "batch_size")
    return out


def _musubi_frames(out: DatasetFile, d: dict, entry: dict, where: str) -> list[tuple[str, dict]]:
    """A video dataset's frame settings: one entry per target frame count, its windows from frame_extraction."""
    how = _get(d, "frame_extraction", str, where, "head")
    targets = _get(d, "target_frames", (list, int), where, [1])
    targets = [targets] if isinstance(targets, int) else targets
    if not targets or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in targets):
        raise ConfigError(f"{where}.target_frames={targets!r}: must be a list of frame counts, e.g. [1, 25, 45]")
    if how == "head":
        window: dict = {"window": "first"}
    elif how == "chunk":
        window = {"window": "chunks", "windows_per_clip": 0}
    elif how == "uniform":
        window = {"window": "uniform", "windows_per_clip": _positive(d, "frame_sample", where, 1)}
    elif how == "slide":
        window = {"window": "chunks", "windows_per_clip": 0}
        out._approximate(f"frame_extraction=slide (frame_stride={d.get('frame_stride', 1)}): window=chunks "
                         "(consecutive windows; wanexp has no sliding start)")
    elif how == "full":
        most = _positive(d, "max_frames", where, 129)
        targets = [most - (most - 1) % 4]  # musubi-tuner trims a full clip to N*4+1 frames, at most max_frames
        window = {"window": "first"}
        out._approximate(f"frame_extraction=full: every clip at max_frames={targets[0]} frames (shorter clips are "
                         "rejected, not trimmed)")
    else:
        raise ConfigError(f"{where}.frame_extraction={how!r}: one of head, chunk, slide, uniform, full")
    return [(f"{t}f", {**entry, "num_frames": t, **window}) for t in dict.fromkeys(targets)]


# ---- diffusion-pipe ------------------------------------------------------------------------------------------------
PIPE_USED = {"path", "num_repeats", "resolutions", "enable_ar_bucket", "min_ar", "max_ar", "num_ar_buckets",
             "ar_buckets", "frame_buckets", "size_buckets", "caption_prefix", "directory"}
PIPE_WHY = {"skip_empty_caption": "a clip without a caption is always rejected"}


def _diffusion_pipe(path: Path, doc: dict, base: Path) -> DatasetFile:
    out = DatasetFile(path, "diffusion-pipe")
    top = {k: v for k, v in doc.items() if k != "directory"}
    if not doc["directory"]:
        raise ConfigError(f"{path}: [[directory]] is empty; list at least one directory")
    for i, directory in enumerate(doc["directory"]):
        where = f"{path.name}: directory[{i}]"
        if not isinstance(directory, dict):
            raise ConfigError(f"{where}: must be a table ([[directory]])")
        d = {**top, **directory}
        if not d.get("path"):
            raise ConfigError(f"{where}: no path; set path = '/folder/of/clips'")
        folder = _path(_get(d, "path", str, where), base)
        entry: dict = {"metadata": folder, "repeat": _positive(d, "num_repeats", where, 1), "caption_extension": ".txt"}
        prefix = _get(d, "caption_prefix", str, where, "")
        if prefix:
            entry["caption_prefix"] = prefix
        frames = _get(d, "frame_buckets", list, where, [1])
        variants: list[tuple[str, dict]]
        sizes = _get(d, "size_buckets", list, where)
        if sizes is not None:
            if not sizes or not all(isinstance(s, list) and len(s) == 3 and all(
                    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in s) for s in sizes):
                raise ConfigError(f"{where}.size_buckets={sizes!r}: must be a list of [width, height, frames]")
            _shape(entry, [[h, w] for h, w in dict.fromkeys((s[1], s[0]) for s in sizes)])
            frames = [s[2] for s in sizes]
            variants = [("", entry)]
        else:
            variants = [(suffix, {**entry, **shape}) for suffix, shape in _pipe_shapes(out, d, where)]
        videos = sorted({f for f in frames if isinstance(f, int) and f > 1})
        if videos:
            variants = [(s, {**e, "num_frames": videos[0]}) for s, e in variants]
            if len(videos) > 1:
                out._approximate(f"frame_buckets {videos}: every clip at {videos[0]} frames (one frame count per "
                                 "dataset; longer buckets not used)")
        _add(out, _name(folder, {}), variants)
        out._ignore(f"{k} ({PIPE_WHY[k]})" if k in PIPE_WHY else k for k in d
                    if k not in PIPE_USED and not (k == "skip_empty_caption" and d[k] is True))
    return out


def _pipe_shapes(out: DatasetFile, d: dict, where: str) -> list[tuple[str, dict]]:
    """One (suffix, height/width or buckets) per entry of ``resolutions``, each of that area."""
    resolutions = _get(d, "resolutions", list, where)
    if not resolutions:
        raise ConfigError(f"{where}: no resolutions; set resolutions = [512] (a side) or [[1280, 720]]")
    areas = []
    for r in resolutions:
        if isinstance(r, list) and len(r) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in r):
            areas.append((f"{r[0]}x{r[1]}", r[0] * r[1]))
        elif isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0:
            areas.append((f"{r}", r * r))
        else:
            raise ConfigError(f"{where}.resolutions: {r!r} is neither a side length nor [width, height]")
    if not _get(d, "enable_ar_bucket", bool, where, False):
        ratios: list[float] = [1.0]
    elif d.get("ar_buckets"):
        ratios = []
        for a in _get(d, "ar_buckets", list, where):
            if isinstance(a, list) and len(a) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in a):
                ratios.append(a[0] / a[1])
            elif isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0:
                ratios.append(float(a))
            else:
                raise ConfigError(f"{where}.ar_buckets: {a!r} is neither a width/height ratio nor [width, height]")
    else:
        low, high = (float(_get(d, k, (int, float), where, v)) for k, v in (("min_ar", 0.5), ("max_ar", 2.0)))
        n = _positive(d, "num_ar_buckets", where, 7)
        ratios = [low * (high / low) ** (i / (n - 1)) for i in range(n)] if n > 1 else [low]
    shapes = []
    for suffix, area in areas:
        entry: dict = {}
        _shape(entry, area_buckets(area, ratios))
        shapes.append((suffix, entry))
    return shapes


# ---- ai-toolkit ----------------------------------------------------------------------------------------------------
AIT_USED = {"folder_path", "dataset_path", "caption_ext", "caption_type", "caption_dropout_rate", "num_frames",
            "resolution", "buckets", "num_repeats", "trigger_word", "shrink_video_to_frames", "fps", "batch_size",
            "type"}


def _ai_toolkit_entries(path: Path, doc) -> tuple[list, dict]:
    """ai-toolkit's dataset list: a job config's ``config.process[*].datasets`` (with that process's ``train``),
    a ``datasets:`` mapping, or the list itself."""
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict):
        for process in doc["config"].get("process") or []:
            if isinstance(process, dict) and isinstance(process.get("datasets"), list):
                return process["datasets"], process.get("train") or {}
    if isinstance(doc, dict) and isinstance(doc.get("datasets"), list):
        return doc["datasets"], {}
    if isinstance(doc, list):
        return doc, {}
    raise ConfigError(f"{path}: no ai-toolkit datasets list (config.process[].datasets, datasets:, or a list of "
                      "{folder_path: ...})")


def _ai_toolkit(path: Path, entries: list, train: dict, base: Path) -> DatasetFile:
    out = DatasetFile(path, "ai-toolkit")
    if not entries:
        raise ConfigError(f"{path}: the datasets list is empty; list at least one dataset")
    batch: list[int] = []
    dropout: list[float] = []
    for i, d in enumerate(entries):
        where = f"{path.name}: datasets[{i}]"
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: must be a mapping with folder_path")
        source = d.get("folder_path") or d.get("dataset_path")
        if not source:
            raise ConfigError(f"{where}: no folder_path; set folder_path: /folder/of/clips")
        folder = _path(_get(d, "folder_path" if d.get("folder_path") else "dataset_path", str, where), base)
        ext = str(_get(d, "caption_ext", str, where) or _get(d, "caption_type", str, where) or ".txt")
        entry: dict = {"metadata": folder, "repeat": _positive(d, "num_repeats", where, 1),
                       "caption_extension": ext if ext.startswith(".") else f".{ext}",
                       "num_frames": _positive(d, "num_frames", where, 1)}
        trigger = _get(d, "trigger_word", str, where)
        if trigger:
            entry["caption_prefix"] = f"{trigger}, "
            out._approximate(f"trigger_word: caption_prefix '{trigger}, ' (prepended to every caption, also one "
                             "that holds it or [trigger])")
        if entry["num_frames"] > 1:
            if _get(d, "shrink_video_to_frames", bool, where, True):
                out._approximate("shrink_video_to_frames: num_frames consecutive frames at the model's rate, not "
                                 "spread over the whole clip")
            elif d.get("fps") is not None:
                entry["fps"] = _positive(d, "fps", where, 24)
        rate = _get(d, "caption_dropout_rate", (int, float), where, 0.0)
        dropout.append(float(rate))
        if d.get("batch_size") is not None:
            batch.append(_positive(d, "batch_size", where, 1))
        resolution = _get(d, "resolution", (int, list), where, 512)
        sides = resolution if isinstance(resolution, list) else [resolution]
        if not sides or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sides):
            raise ConfigError(f"{where}.resolution={resolution!r}: must be a side length or a list of them")
        bucketed = _get(d, "buckets", bool, where, True)
        variants = []
        for side in dict.fromkeys(sides):
            e = dict(entry)
            _shape(e, area_buckets(side * side, COMMON_RATIOS if bucketed else [1.0]))
            variants.append((str(side), e))
        if bucketed:
            out._approximate("buckets: data.buckets of 7 aspect ratios (16:9 to 9:16) of each resolution's area")
        _add(out, _name(folder, {}), variants)
        out._ignore(k for k in d if k not in AIT_USED)
    if not batch and isinstance(train, dict) and train.get("batch_size") is not None:
        batch.append(_positive(train, "batch_size", f"{path.name}: train", 1))
    _one_group_value(out, "batch_size", batch, "batch_size")
    if any(dropout):
        _one_group_value(out, "caption_dropout", dropout, "caption_dropout_rate")
    return out


# ---- in a composed config ------------------------------------------------------------------------------------------
def dataset_file_setting(value) -> str | None:
    """The file a ``data.datasets`` value names (a string), or None (a list, a mapping, null)."""
    return value if isinstance(value, str) and value.strip() else None


def apply_dataset_file(cfg, overrides=(), say: bool = True) -> DatasetFile | None:
    """``data.datasets=FILE`` in a composed config: the file's datasets replace it, and the data group keys the file
    sets (batch size, caption dropout) replace the group's, except those the command line sets (``data.<key>=``);
    ``data.name`` becomes the file's name unless set. ``say``: print what did not map as one warning line. None when
    ``data.datasets`` names no file."""
    from omegaconf import OmegaConf, open_dict

    value = OmegaConf.select(cfg, "data.datasets", default=None)
    if dataset_file_setting(value) is None:
        return None
    found = read_dataset_file(value)
    given = {str(o).lstrip("+~").partition("=")[0] for o in overrides}
    with open_dict(cfg):
        cfg.data.datasets = found.datasets
        for key, v in found.group.items():
            if f"data.{key}" not in given:
                cfg.data[key] = v
        if "data.name" not in given:
            cfg.data.name = _name(str(found.path), {})
    if say and found.warning:
        print(f"wanexp: warning: {found.warning}", flush=True)
    return found
