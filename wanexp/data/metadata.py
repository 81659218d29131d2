"""Read MBC-style captioned-media metadata (CSV, JSON or JSONL) into ``Sample`` records.

A metadata file lists one media file and one prompt per row. Accepted column
names (case-insensitive, first non-empty one wins):

* media:  ``video``, ``image``, ``file_name``, ``path``
* prompt: ``prompt``, ``caption``, ``text``

Relative media paths resolve against ``root`` if given, else the metadata file's folder.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wanexp.errors import MetadataError

__all__ = [
    "IMAGE_EXTENSIONS",
    "MEDIA_COLUMNS",
    "METADATA_EXTENSIONS",
    "PROMPT_COLUMNS",
    "VIDEO_EXTENSIONS",
    "MetadataError",
    "Sample",
    "media_kind",
    "missing_files",
    "read_metadata",
]

MEDIA_COLUMNS: tuple[str, ...] = ("video", "image", "file_name", "path")
PROMPT_COLUMNS: tuple[str, ...] = ("prompt", "caption", "text")
IMAGE_EXTENSIONS: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif"})
METADATA_EXTENSIONS: tuple[str, ...] = (".csv", ".json", ".jsonl")


@dataclass(frozen=True)
class Sample:
    """One captioned media file: absolute ``path``, ``prompt`` and ``kind`` ("video"/"image")."""

    path: str
    prompt: str
    kind: str


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


# A parsed row: (1-based row number, physical line number or None, normalised mapping).
_Row = tuple[int, int | None, dict[str, Any]]


def _normalise(row: Mapping[Any, Any]) -> dict[str, Any]:
    """Lower-case and strip keys; drop keys that are not strings (csv extras)."""
    return {k.strip().lower(): v for k, v in row.items() if isinstance(k, str)}


def _iter_csv(path: Path) -> tuple[list[str] | None, list[_Row]]:
    with path.open("r", encoding="utf-8-sig", newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames
        rows: list[_Row] = []
        for index, row in enumerate(reader, start=1):
            if not any((v or "").strip() for k, v in row.items() if isinstance(v, str)):
                continue  # blank line
            rows.append((index, reader.line_num, _normalise(row)))
    columns = None if header is None else [h.strip() for h in header]
    return columns, rows


def _iter_json(path: Path) -> list[_Row]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise MetadataError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); fix the syntax"
        ) from None
    if not isinstance(data, list):
        raise MetadataError(
            f"{path}: expected a JSON list of objects but got {type(data).__name__}; "
            'write it as [{"video": ..., "prompt": ...}, ...]'
        )
    rows: list[_Row] = []
    for index, item in enumerate(data, start=1):
        if not isinstance(item, dict):
            raise MetadataError(
                f"{path}: row {index} is {type(item).__name__}, not an object; "
                'each entry must look like {"video": ..., "prompt": ...}'
            )
        rows.append((index, None, _normalise(item)))
    return rows


def _iter_jsonl(path: Path) -> list[_Row]:
    rows: list[_Row] = []
    with path.open("r", encoding="utf-8-sig") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MetadataError(
                    f"{path}: invalid JSON on line {line_no} ({exc.msg}); "
                    "each line must be one JSON object"
                ) from None
            if not isinstance(item, dict):
                raise MetadataError(
                    f"{path}: line {line_no} is {type(item).__name__}, not an object; "
                    'each line must look like {"video": ..., "prompt": ...}'
                )
            rows.append((len(rows) + 1, line_no, _normalise(item)))
    return rows


def _where(index: int, line: int | None) -> str:
    return f"row {index}" if line is None else f"row {index} (line {line})"


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
    found_list = [str(c) for c in found]
    if not any(c.strip().lower() in accepted for c in found_list):
        raise MetadataError(
            f"{path}: no {what} column; accepted names are {', '.join(accepted)} "
            f"but found columns: {', '.join(found_list) or '(none)'}; rename the column that holds the {what}"
        )


def read_metadata(
    metadata_path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None
) -> list[Sample]:
    """Read a CSV/JSON/JSONL metadata file into samples with absolute media paths.

    Raises ``MetadataError`` (one line naming the file and the fix) for a missing file,
    an unsupported format, missing media/prompt columns, empty cells, unknown media
    extensions or zero rows. Media files themselves are not checked (see ``missing_files``).
    """
    path = Path(os.path.abspath(os.path.expanduser(os.fspath(metadata_path))))
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise MetadataError(
            f"{path}: metadata file {reason}; check the path (relative paths are taken from {os.getcwd()})"
        )
    ext = path.suffix.lower()
    if ext not in METADATA_EXTENSIONS:
        raise MetadataError(
            f"{path}: unsupported metadata format {ext or '(no extension)'!r}; "
            f"use one of {', '.join(METADATA_EXTENSIONS)}"
        )

    try:
        if ext == ".csv":
            header, rows = _iter_csv(path)
            if header is None:
                raise MetadataError(
                    f"{path}: file is empty; add a header row (e.g. video,prompt) and at least one data row"
                )
            _check_columns(path, header, accepted=MEDIA_COLUMNS, what="media")
            _check_columns(path, header, accepted=PROMPT_COLUMNS, what="prompt")
        elif ext == ".json":
            rows = _iter_json(path)
        else:
            rows = _iter_jsonl(path)
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{path}: not valid UTF-8 text ({exc.reason}); save it as UTF-8") from None

    if not rows:
        raise MetadataError(f"{path}: no rows; add at least one row with a media path and a prompt")

    base = Path(os.path.abspath(os.path.expanduser(os.fspath(root)))) if root is not None else path.parent
    samples: list[Sample] = []
    for index, line, row in rows:
        where = _where(index, line)
        _check_columns(path, row.keys(), accepted=MEDIA_COLUMNS, what="media")
        _check_columns(path, row.keys(), accepted=PROMPT_COLUMNS, what="prompt")
        media = _first_value(row, MEDIA_COLUMNS)
        if not media:
            raise MetadataError(f"{path}: empty media path on {where}; fill it in or remove the row")
        prompt = _first_value(row, PROMPT_COLUMNS)
        if not prompt:
            raise MetadataError(f"{path}: empty prompt on {where}; write a caption or remove the row")
        kind = media_kind(media)
        if kind is None:
            known = ", ".join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS))
            raise MetadataError(
                f"{path}: unsupported media extension {Path(media).suffix or '(none)'!r} "
                f"in {_one_line(media)!r} on {where}; use one of {known}"
            )
        media_path = Path(os.path.expanduser(media))
        if not media_path.is_absolute():
            media_path = base / media_path
        samples.append(Sample(path=os.path.normpath(media_path), prompt=prompt, kind=kind))
    return samples


def missing_files(samples: Iterable[Sample]) -> list[str]:
    """Return the paths of samples whose media file does not exist (in input order)."""
    return [s.path for s in samples if not os.path.isfile(s.path)]
