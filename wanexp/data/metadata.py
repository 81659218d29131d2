"""Read captioned-media metadata into ``Sample`` records, rejecting bad rows one by one.

Accepted inputs:

* a CSV file (DiffSynth-Studio style: columns ``video,prompt``; ``video`` may also name an image),
* a JSON list or a JSONL file of objects (VideoX-Fun style: ``file_path``, ``text``, ``type``),
* a folder of media files, each with a same-named caption file beside it (``.txt``, or another
  ``caption_extension``: musubi-tuner / diffusion-pipe / ai-toolkit style); read recursively, hidden files and
  folders skipped, in sorted order.

Column names are case-insensitive; the first non-empty one wins:

* media:  ``video``, ``image``, ``file_name``, ``path``, ``file_path``, ``video_path``, ``image_path``
  (the last two: musubi-tuner's JSONL)
* prompt: ``prompt``, ``caption``, ``text``
* kind:   ``type`` (``video`` or ``image``; when absent or empty the file extension decides)

Relative media paths resolve against ``root`` if given, else the metadata file's folder.

Problems with the whole file (not found, unparsable JSON, no media or prompt column, no rows)
raise a one-line ``MetadataError``. Problems with one row (empty prompt, text that is not
UTF-8, unknown media type, empty media path, a media file without caption) reject that row
only: see ``read_metadata_with_rejects``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wanexp.errors import MetadataError

__all__ = [
    "CAPTION_EXTENSION",
    "IMAGE_EXTENSIONS",
    "MEDIA_COLUMNS",
    "METADATA_EXTENSIONS",
    "PROMPT_COLUMNS",
    "VIDEO_EXTENSIONS",
    "MetadataError",
    "Reject",
    "Sample",
    "media_kind",
    "missing_files",
    "read_metadata",
    "read_metadata_with_rejects",
]

log = logging.getLogger(__name__)

MEDIA_COLUMNS: tuple[str, ...] = ("video", "image", "file_name", "path", "file_path", "video_path", "image_path")
PROMPT_COLUMNS: tuple[str, ...] = ("prompt", "caption", "text")
KIND_COLUMN = "type"
IMAGE_EXTENSIONS: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif"})
METADATA_EXTENSIONS: tuple[str, ...] = (".csv", ".json", ".jsonl")
CAPTION_EXTENSION = ".txt"


@dataclass(frozen=True)
class Sample:
    """One captioned media file: absolute ``path``, ``prompt`` and ``kind`` ("video"/"image"); ``inputs``: the
    model family's sample inputs as (column, absolute file path) pairs (ModelSpec.sample_inputs)."""

    path: str
    prompt: str
    kind: str
    inputs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Reject:
    """A row or file left out, and why.

    ``source`` is ``"<metadata file>:<line>"`` (the line where the row starts; a JSON list adds
    ``" (entry <n>)"``, counted from 1) or, for a caption folder or a media check, the media path;
    ``path`` is the media path ("" when the row has none); ``reason`` is one short line such as
    ``"empty prompt"``.
    """

    source: str
    path: str
    reason: str


def media_kind(path: str | os.PathLike[str]) -> str | None:
    """Return ``"video"`` or ``"image"`` from the file extension, or ``None`` if unknown."""
    ext = Path(path).suffix.lower()
    if ext in VIDEO_EXTENSIONS:
        return "video"
    if ext in IMAGE_EXTENSIONS:
        return "image"
    return None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _is_utf8(text: str) -> bool:
    """False if ``text`` holds undecodable bytes (lone surrogates from ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """``text`` with undecodable bytes shown as U+FFFD, safe to print or log."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that did not come from a byte (e.g. a JSON "\ud800" escape)
        return text.encode("utf-8", "replace").decode("utf-8")


def _read_text(path: Path) -> str:
    """The file as text; bytes that are not UTF-8 survive as lone surrogates, to be rejected per row."""
    return path.read_bytes().decode("utf-8-sig", errors="surrogateescape")


# A parsed row: (where it is: the line it starts on, plus the entry number in a JSON list; the normalised
# mapping, or None for a JSON entry that is not an object).
_Row = tuple[str, "dict[str, Any] | None"]


def _normalise(row: Mapping[Any, Any]) -> dict[str, Any]:
    """Lower-case and strip keys; drop keys that are not strings (csv extras)."""
    return {k.strip().lower(): v for k, v in row.items() if isinstance(k, str)}


def _iter_csv(path: Path, text: str) -> tuple[list[str] | None, list[_Row]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[_Row] = []
    try:
        header = next(reader, None)
        start = reader.line_num + 1
        for values in reader:
            if any(v.strip() for v in values):  # else a blank line
                rows.append((str(start), _normalise(dict(zip(header or [], values)))))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise MetadataError(f"{path}: unreadable CSV at line {reader.line_num} ({_one_line(exc)})") from None
    columns = None if header is None else [h.strip() for h in header]
    return columns, rows


def _iter_json(path: Path, text: str) -> list[_Row]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MetadataError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); fix the syntax"
        ) from None
    if not isinstance(data, list):
        raise MetadataError(
            f"{path}: expected a JSON list of objects but got {type(data).__name__}; "
            'write it as [{"video": ..., "prompt": ...}, ...]'
        )
    # Second pass over the (valid) list to find the line each entry starts on.
    decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, line, rows = text.index("[") + 1, 1, []
    line += text.count("\n", 0, pos)
    for number, _ in enumerate(data, start=1):
        start = skip.match(text, pos).end()
        line += text.count("\n", pos, start)
        item, pos = decoder.raw_decode(text, start)
        rows.append((f"{line} (entry {number})", _normalise(item) if isinstance(item, dict) else None))
        line += text.count("\n", start, pos)
    return rows


def _iter_jsonl(path: Path, text: str) -> list[_Row]:
    rows: list[_Row] = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetadataError(
                f"{path}: invalid JSON on line {line_no} ({exc.msg}); each line must be one JSON object"
            ) from None
        rows.append((str(line_no), _normalise(item) if isinstance(item, dict) else None))
    return rows


def _first_value(row: Mapping[str, Any], columns: Iterable[str]) -> str:
    for column in columns:
        value = row.get(column)
        if value is None:
            continue
        text = str(value).strip()
        if text:
            return text
    return ""


def _check_columns(path: Path, found: Iterable[str], *, accepted: tuple[str, ...], what: str) -> None:
    found_list = [_printable(str(c)) for c in found]
    if not any(c.strip().lower() in accepted for c in found_list):
        raise MetadataError(
            f"{path}: no {what} column; accepted names are {', '.join(accepted)} "
            f"but found columns: {', '.join(found_list) or '(none)'}; rename the column that holds the {what}"
        )


def _resolved(value: str, base: Path) -> str:
    """A metadata path as an absolute, normalised path (relative ones from ``base``)."""
    path = Path(os.path.expanduser(value))
    return os.path.normpath(_printable(str(path if path.is_absolute() else base / path)))


def _row_inputs(row: Mapping[str, Any], base: Path, inputs: tuple[str, ...], media: str = "",
                fallbacks: Mapping[str, tuple[str, ...]] | None = None) -> tuple[tuple | None, str]:
    """((column, path), ...) of the sample inputs a row names, or (None, reject reason). ``fallbacks``: for an
    input a row may leave out, the other columns it is read from; a row with none of them gives the media path
    ``media`` (the family finds the input from the clip itself, e.g. its audio stream)."""
    found = []
    for column in inputs:
        others = (fallbacks or {}).get(column)
        value = _first_value(row, (column, *(others or ())))
        if not value and others is not None:
            value = media
        if not value:
            return None, f"no {column} (a sample input of this model: set the {column} column)"
        if not _is_utf8(value):
            return None, f"{column} path is not UTF-8"
        found.append((column, _resolved(value, base)))
    return tuple(found), ""


def _row_sample(row: Mapping[str, Any] | None, base: Path, inputs: tuple[str, ...] = (),
                fallbacks: Mapping[str, tuple[str, ...]] | None = None) -> tuple[Sample | None, str, str]:
    """(sample, media path, "") for a good row, else (None, media path or "", reject reason)."""
    if row is None:
        return None, "", "entry is not a JSON object"
    media = _first_value(row, MEDIA_COLUMNS)
    if not media:
        return None, "", "empty media path"
    shown = _resolved(media, base)
    if not _is_utf8(media):
        return None, shown, "media path is not UTF-8"
    prompt = _first_value(row, PROMPT_COLUMNS)
    if not prompt:
        return None, shown, "empty prompt"
    if not _is_utf8(prompt):
        return None, shown, "prompt is not UTF-8"
    declared = str(row.get(KIND_COLUMN) or "").strip().lower()
    if declared and declared not in ("video", "image"):
        return None, shown, f"unknown type {_printable(_one_line(declared))!r}"
    kind = declared or media_kind(media)
    if kind is None:
        return None, shown, f"unknown media type {_printable(Path(media).suffix) or '(no extension)'!r}"
    found, reason = _row_inputs(row, base, inputs, media, fallbacks)
    if found is None:
        return None, shown, reason
    return Sample(path=shown, prompt=prompt, kind=kind, inputs=found), shown, ""


def _read_file(path: Path, base: Path, inputs: tuple[str, ...] = (),
               fallbacks: Mapping[str, tuple[str, ...]] | None = None) -> tuple[list[Sample], list[Reject]]:
    ext = path.suffix.lower()
    if ext not in METADATA_EXTENSIONS:
        raise MetadataError(
            f"{path}: unsupported metadata format {ext or '(no extension)'!r}; "
            f"use one of {', '.join(METADATA_EXTENSIONS)}, or a folder of media with .txt captions"
        )
    try:
        text = _read_text(path)
    except OSError as exc:
        raise MetadataError(f"{path}: cannot read the metadata file ({_one_line(exc.strerror or exc)})") from None
    if ext == ".csv":
        header, rows = _iter_csv(path, text)
        if header is None:
            raise MetadataError(
                f"{path}: file is empty; add a header row (e.g. video,prompt) and at least one data row"
            )
    else:
        rows = _iter_json(path, text) if ext == ".json" else _iter_jsonl(path, text)
        header = list(dict.fromkeys(k for _, row in rows if row is not None for k in row))
    if not rows:
        raise MetadataError(f"{path}: no rows; add at least one row with a media path and a prompt")
    _check_columns(path, header, accepted=MEDIA_COLUMNS, what="media")
    _check_columns(path, header, accepted=PROMPT_COLUMNS, what="prompt")

    samples: list[Sample] = []
    rejects: list[Reject] = []
    for where, row in rows:
        sample, media, reason = _row_sample(row, base, inputs, fallbacks)
        if sample is None:
            rejects.append(Reject(source=f"{path}:{where}", path=media, reason=reason))
        else:
            samples.append(sample)
    return samples, rejects


def _read_caption(media: Path, extension: str = CAPTION_EXTENSION) -> tuple[str, str]:
    """(caption, "") from ``<stem><extension>`` (``.txt``) beside ``media``, else ("", reject reason)."""
    caption = media.with_suffix(extension)
    try:
        text = caption.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        return "", f"no caption file {caption.name!r}"
    except UnicodeDecodeError:
        return "", "caption is not UTF-8"
    except OSError as exc:
        return "", f"cannot read caption ({_one_line(exc.strerror or exc)})"
    text = text.strip()
    return (text, "") if text else ("", "empty caption")


def _read_folder(folder: Path, inputs: tuple[str, ...] = (), fallbacks: Mapping[str, tuple[str, ...]] | None = None,
                 caption_extension: str = CAPTION_EXTENSION) -> tuple[list[Sample], list[Reject]]:
    media: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        media += [Path(dirpath, f) for f in filenames if not f.startswith(".") and media_kind(f) is not None]
    if not media:
        raise MetadataError(
            f"{folder}: no media files found (looked for {', '.join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS))}); "
            f"point data.metadata at a folder of clips/images with {caption_extension} captions, or at a "
            "CSV/JSON/JSONL file"
        )
    samples: list[Sample] = []
    rejects: list[Reject] = []
    for path in sorted(media, key=lambda p: p.relative_to(folder).as_posix()):
        prompt, reason = _read_caption(path, caption_extension)
        shown = _printable(os.fspath(path))
        required = [c for c in inputs if c not in (fallbacks or {})]
        if not reason and required:  # a caption file names no other file
            reason = f"no {required[0]} (a sample input of this model: list the samples in a metadata file)"
        if reason:
            rejects.append(Reject(source=shown, path=shown, reason=reason))
        else:
            samples.append(Sample(path=shown, prompt=prompt, kind=media_kind(path) or "",
                                  inputs=tuple((c, shown) for c in inputs)))
    return samples, rejects


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def read_metadata_with_rejects(
    metadata_path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None, inputs: tuple[str, ...] = (),
    fallbacks: Mapping[str, tuple[str, ...]] | None = None, caption_extension: str = CAPTION_EXTENSION,
) -> tuple[list[Sample], list[Reject]]:
    """Read a CSV/JSON/JSONL metadata file, or a folder of captioned media, into (samples, rejects).

    Samples have absolute media paths; rows that cannot become a sample are returned as
    ``Reject`` records, in file order. ``root`` (relative media paths) is not used for a folder. ``inputs``: the
    model family's sample input columns (ModelSpec.sample_inputs), each a path resolved like the media's; a row
    without one is a reject, unless ``fallbacks`` (ModelSpec.sample_input_fallbacks) names other columns for it:
    then a row without any of them gives the media path itself. ``caption_extension``: a folder's caption files
    (``clip.mp4`` + ``clip<caption_extension>``).
    Raises a one-line ``MetadataError`` for problems with the whole file (see the module doc).
    Media files themselves are not opened (see ``missing_files`` and ``wanexp.data.probe``).
    """
    path = _absolute(metadata_path)
    if path.is_dir():
        return _read_folder(path, inputs, fallbacks, caption_extension)
    if not path.is_file():
        raise MetadataError(
            f"{path}: metadata file not found; check the path (relative paths are taken from {os.getcwd()})"
        )
    base = _absolute(root) if root is not None else path.parent
    return _read_file(path, base, inputs, fallbacks)


def read_metadata(
    metadata_path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None
) -> list[Sample]:
    """Like ``read_metadata_with_rejects`` but returns the samples only.

    Rejected rows are left out and logged as one warning; if every row is rejected it raises a
    ``MetadataError`` naming the first reject.
    """
    samples, rejects = read_metadata_with_rejects(metadata_path, root)
    if rejects and not samples:
        first = rejects[0]
        raise MetadataError(
            f"{_absolute(metadata_path)}: no usable rows, all {len(rejects)} rejected "
            f"(first: {first.source}: {first.reason}); fix or remove the rejected rows"
        )
    if rejects:
        log.warning(
            "%s: left out %d of %d rows (first: %s: %s)",
            _absolute(metadata_path), len(rejects), len(samples) + len(rejects), rejects[0].source, rejects[0].reason,
        )
    return samples


def missing_files(samples: Iterable[Sample]) -> list[str]:
    """Return the paths of samples whose media file does not exist (in input order)."""
    return [s.path for s in samples if not os.path.isfile(s.path)]


# ---- prompts alone (no media): what DMD distils from ---------------------------------------------------------------
PROMPT_KIND = "prompt"  # the kind of a Sample read from a file of prompts alone; its ``path`` names the row
PROMPT_FILE_EXTENSIONS: tuple[str, ...] = (".txt", *METADATA_EXTENSIONS)


def _prompt_rows(path: Path, text: str) -> tuple[list[str], list[_Row]]:
    """(columns, rows) of a prompts file: a .txt file is one prompt a line, a JSON list may hold plain strings."""
    ext = path.suffix.lower()
    if ext == ".txt":
        return ["prompt"], [(str(n), {"prompt": line}) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if ext == ".csv":
        header, rows = _iter_csv(path, text)
        return header or [], rows
    if ext == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None  # _iter_json says where
        if isinstance(data, list) and data and all(isinstance(v, str) for v in data):
            return ["prompt"], [(f"entry {n}", {"prompt": v}) for n, v in enumerate(data, 1)]
    rows = _iter_json(path, text) if ext == ".json" else _iter_jsonl(path, text)
    return list(dict.fromkeys(k for _, row in rows if row is not None for k in row)), rows


def read_prompts(metadata_path: str | os.PathLike[str]) -> tuple[list[Sample], list[Reject]] | None:
    """A metadata file of prompts alone -- .txt lines, or CSV/JSON/JSONL with a prompt column and no media column --
    as (samples of kind ``PROMPT_KIND``, rejects); None for anything else (media rows, a folder: read_metadata's)."""
    path = _absolute(metadata_path)
    if not path.is_file() or path.suffix.lower() not in PROMPT_FILE_EXTENSIONS:
        return None
    try:
        text = _read_text(path)
    except OSError as exc:
        raise MetadataError(f"{path}: cannot read the metadata file ({_one_line(exc.strerror or exc)})") from None
    columns, rows = _prompt_rows(path, text)
    names = {c.strip().lower() for c in columns}
    if names & set(MEDIA_COLUMNS) or not names & set(PROMPT_COLUMNS):
        return None
    if not rows:
        raise MetadataError(f"{path}: no prompts; add at least one prompt (one a line in a .txt file)")
    samples: list[Sample] = []
    rejects: list[Reject] = []
    for where, row in rows:
        prompt = _first_value(row, PROMPT_COLUMNS) if row is not None else ""
        reason = "entry is not a JSON object" if row is None else "empty prompt" if not prompt else \
            "" if _is_utf8(prompt) else "prompt is not UTF-8"
        if reason:
            rejects.append(Reject(source=f"{path}:{where}", path="", reason=reason))
        else:
            samples.append(Sample(path=f"{path}:{where}", prompt=prompt, kind=PROMPT_KIND))
    return samples, rejects
