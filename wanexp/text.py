"""Prompt cleaning, shared by text encoding (online and cached) and the data checks: it must match inference."""
from __future__ import annotations

import html
import re

try:  # ftfy fixes mojibake; the cleaning must match between caching and inference.
    import ftfy
except ImportError:  # pragma: no cover - ftfy is a pinned dependency
    ftfy = None


def clean_prompt(text: str) -> str:
    """ftfy fix + double html unescape + whitespace collapse (the Wan prompt cleaning)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()
