"""Your data as a data group of your own: a YAML in your config folder (./conf/data/, or $WANEXP_CONFIG_DIR/data/),
which every command finds by its name.

    python -m wanexp.cli.dataset init /data/my_clips --name my_clips       # a folder of clips with caption files
    python -m wanexp.cli.dataset init /data/set/metadata.csv --name my_csv  # a DiffSynth-style CSV (or JSON/JSONL)
    python -m wanexp.cli.dataset convert dataset.toml --name my_data        # musubi-tuner / diffusion-pipe TOML,
                                                                            # ai-toolkit YAML
    python train.py data=my_clips model.path=...

``init`` looks at what the folder or file holds (the caption files' extension, a metadata file beside the media, the
rows it can read, the size and length of the first media files) and writes a group extending ``folder`` or ``csv``
(conf/data/), with aspect buckets when the media come in both orientations. ``convert`` writes the mapping of
``wanexp.config.dataset_files`` (what ``data.datasets=FILE`` reads directly) and names, in one line, what it could not
map. Bad input is one line, exit code 2, and nothing is written.
"""
from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from pathlib import Path

from wanexp.errors import ConfigError, UserError, refuse

CAPTION_EXTENSIONS = (".txt", ".caption", ".cap", ".text")  # looked for beside a folder's media, .txt first
PROBE_FILES = 64  # media files init opens to see their sizes and lengths
BUCKETS = [[704, 1280], [1280, 704], [960, 960]]  # the data group's 704x1280 in both orientations and square


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m wanexp.cli.dataset", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    i = sub.add_parser("init", help="a data group for a folder of clips (captions beside them) or a metadata file")
    i.add_argument("path", help="the folder of clips and images, or a CSV/JSON/JSONL metadata file")
    c = sub.add_parser("convert", help="a data group from a musubi-tuner or diffusion-pipe dataset TOML or an "
                                       "ai-toolkit config YAML/JSON")
    c.add_argument("path", help="the dataset file")
    for p in (i, c):
        p.add_argument("--name", help="the group's name: data=NAME (default: the folder's or file's name)")
        p.add_argument("--conf-dir", help="your config folder; the file goes to CONF_DIR/data/NAME.yaml (default: "
                                          "$WANEXP_CONFIG_DIR, else ./conf)")
        p.add_argument("--force", action="store_true", help="replace an existing file of that name")
    return ap.parse_args(argv)


def main(argv=None) -> Path:
    args = _parse(argv)
    try:
        return init(args) if args.command == "init" else convert(args)
    except UserError as e:
        refuse(str(e))


def entry() -> None:
    """The console command."""
    main()


# ---- where the group goes ------------------------------------------------------------------------------------------
def group_file(name: str, conf_dir: str | None, force: bool) -> Path:
    """CONF_DIR/data/NAME.yaml: a name Hydra can take that wanexp does not ship, in a file not there yet (``force``:
    replaced)."""
    from wanexp.config import CONF_DIR
    from wanexp.config.folders import ENV

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name or ""):
        raise ConfigError(f"--name {name!r}: letters, digits, _ and - (it is what data=NAME names)")
    if (CONF_DIR / "data" / f"{name}.yaml").is_file():
        raise ConfigError(f"--name {name}: wanexp ships data={name} (conf/data/{name}.yaml), which would be used "
                          "instead of yours; pick another name")
    folder = Path(conf_dir or os.environ.get(ENV) or "conf").expanduser().absolute()
    out = folder / "data" / f"{name}.yaml"
    if out.exists() and not force:
        raise ConfigError(f"{out}: already exists; pass --force to replace it, or another --name")
    return out


def _write(out: Path, text: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)


def _yaml(values: dict) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False, default_flow_style=None, width=118, allow_unicode=True)


def _default_name(path: Path) -> str:
    stem = path.stem if path.is_file() else path.name
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_") or "my_data"


# ---- convert -------------------------------------------------------------------------------------------------------
def convert(args) -> Path:
    """The dataset file as a data group: its datasets, its batch size and caption dropout, what did not map noted in
    the file's first lines and printed as one warning line."""
    from wanexp.config.dataset_files import read_dataset_file

    found = read_dataset_file(args.path)
    name = args.name or _default_name(found.path)
    out = group_file(name, args.conf_dir, args.force)
    head = [f"# From {found.path} ({found.kind}), written by python -m wanexp.cli.dataset convert; edit freely.",
            f"# Train with: python train.py data={name} model.path=...  (docs/datasets.md: what maps to what)"]
    if found.ignored:
        head.append(f"# Not mapped: {', '.join(found.ignored)}")
    head += [f"# Approximated: {a}" for a in found.approximated]
    body = _yaml({"defaults": ["mbc_5k", "_self_"], "name": name, **found.group, "datasets": found.datasets})
    _write(out, "\n".join(head) + "\n" + body)
    if found.warning:
        print(f"wanexp: warning: {found.warning}", flush=True)
    print(f"wanexp: wrote {out}: {len(found.datasets)} dataset(s) ({', '.join(found.datasets)}); train with "
          f"python train.py data={name} model.path=...", flush=True)
    return out


# ---- init ----------------------------------------------------------------------------------------------------------
def _media(folder: Path) -> list[Path]:
    from wanexp.data.metadata import media_kind

    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath, f) for f in sorted(filenames) if not f.startswith(".") and media_kind(f)]
    return found


def caption_extension(media: list[Path]) -> str | None:
    """The caption files' extension beside most of ``media`` (.txt on a tie), None when there are none."""
    counts = Counter(ext for m in media for ext in CAPTION_EXTENSIONS if m.with_suffix(ext).is_file())
    return max(CAPTION_EXTENSIONS, key=lambda e: (counts[e], e == ".txt")) if counts else None


def _metadata_file(folder: Path):
    """A metadata file at the top of ``folder`` that reads as media rows ((path, samples, rejects)), or None; one line
    when several do."""
    from wanexp.data.metadata import METADATA_EXTENSIONS, MetadataError, read_metadata_with_rejects

    found = []
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.suffix.lower() in METADATA_EXTENSIONS:
            try:
                samples, rejects = read_metadata_with_rejects(f)
            except MetadataError:
                continue  # not a metadata file of media (another JSON, a prompts list)
            found.append((f, samples, rejects))
    if len(found) > 1:
        raise ConfigError(f"{folder}: holds several metadata files ({', '.join(f.name for f, _, _ in found)}); pass "
                          "the one to train on")
    return found[0] if found else None


def init(args) -> Path:
    """A data group for the user's folder or metadata file, from what it holds."""
    from wanexp.data.metadata import read_metadata_with_rejects, read_prompts

    path = Path(os.path.expanduser(args.path)).absolute()
    if not path.exists():
        raise ConfigError(f"{args.path}: no such folder or file; name your folder of clips or its metadata file")
    name = args.name or _default_name(path)
    out = group_file(name, args.conf_dir, args.force)
    values: dict = {}
    if path.is_file():
        if read_prompts(path) is not None:
            raise ConfigError(f"{path}: holds prompts alone (no media); that trains a distillation "
                              f"(objective=dmd data.metadata={path}), not a data group of clips")
        samples, rejects = read_metadata_with_rejects(path)
        base, what = "csv", f"metadata file {path.name}"
    elif (meta := _metadata_file(path)) is not None:
        path, samples, rejects = meta
        base, what = "csv", f"metadata file {path.name} in {path.parent}"
    else:
        ext = caption_extension(_media(path))
        if ext is None:
            raise ConfigError(f"{path}: no caption files beside its media (looked for {', '.join(CAPTION_EXTENSIONS)} "
                              "files named like each clip), and no metadata CSV/JSON/JSONL file in it")
        samples, rejects = read_metadata_with_rejects(path, caption_extension=ext)
        base, what = "folder", f"folder, captions in {ext} files"
        values["caption_extension"] = ext
    if not samples:
        first = rejects[0] if rejects else None
        raise ConfigError(f"{path}: no usable sample" + (f" ({len(rejects)} rejected, first: {first.source}: "
                                                          f"{first.reason})" if first else ""))
    looked = _look(samples)
    if looked["landscape"] and looked["portrait"]:
        values["buckets"] = BUCKETS
    kinds = Counter(s.kind for s in samples)
    counts = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in sorted(kinds.items()))
    head = [f"# {path} ({what}): {counts}" + (f", {len(rejects)} rows rejected" if rejects else "") +
            ", seen by python -m wanexp.cli.dataset init.",
            f"# Train with: python train.py data={name} model.path=...  (every key of conf/data/{base}.yaml and "
            "mbc_5k.yaml applies)"]
    if looked["line"]:
        head.append(f"# {looked['line']}")
    body = _yaml({"defaults": [base, "_self_"], "name": name, "metadata": str(path), **values})
    _write(out, "\n".join(head) + "\n" + body)
    print(f"wanexp: wrote {out}: {counts}" + (f", {len(rejects)} rejected (first: {rejects[0].source}: "
                                            f"{rejects[0].reason})" if rejects else "") +
          (f"; {looked['line']}" if looked["line"] else "") + f"; train with python train.py data={name} "
          "model.path=...", flush=True)
    return out


def _look(samples) -> dict:
    """What the first ``PROBE_FILES`` media are: how many landscape and portrait, their sizes, the shortest clip."""
    from wanexp.data.probe import probe_samples

    good, _, _ = probe_samples(samples[:PROBE_FILES], 1, 1, 1, 1, workers=4)
    landscape = sum(r.width > r.height for r in good)
    portrait = sum(r.width < r.height for r in good)
    clips = [r for r in good if r.sample.kind == "video" and r.source_fps]
    parts = []
    if good:
        sizes = sorted((r.width * r.height, f"{r.width}x{r.height}") for r in good)
        parts.append(f"of the first {len(good)}: {landscape} landscape, {portrait} portrait, "
                     f"{len(good) - landscape - portrait} square, {sizes[0][1]} to {sizes[-1][1]} (width x height)")
    if landscape and portrait:
        parts.append("both orientations, so buckets (each at the shape nearest its aspect ratio)")
    if clips:
        short = min(clips, key=lambda r: r.frames / r.source_fps)
        parts.append(f"shortest clip {float(short.frames / short.source_fps):.2f} s (a clip shorter than "
                     "data.num_frames at the model's frame rate is rejected)")
    return {"landscape": landscape, "portrait": portrait, "line": "; ".join(parts)}


if __name__ == "__main__":
    main()
