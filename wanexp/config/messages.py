"""Hydra/OmegaConf composition errors as the one line a user reads (a leaf: schema.py and the package use it)."""
from __future__ import annotations

_TYPE_WORDS = {"Float": "a number", "Integer": "an integer", "Boolean": "true or false", "String": "a string"}


def one_line_error(exc: BaseException) -> str:
    """A Hydra/OmegaConf composition error as one line: the key and value, the problem, what is allowed."""
    import re

    cause = exc.__cause__ or exc
    key, value = getattr(cause, "full_key", None), getattr(cause, "value", None)
    first = (getattr(cause, "msg", None) or str(cause) or type(cause).__name__).strip().splitlines()[0]
    m = re.search(r"could not be converted to (\w+)", first) or re.search(r"is not a valid (bool)\b", first)
    if key and m:
        kind = "Boolean" if m.group(1) == "bool" else m.group(1)
        return f"{key}={value}: must be {_TYPE_WORDS.get(kind, kind)}"
    m = re.search(r"Key '([^']+)' not in '(\w+)'", first) or re.search(r"Key '([^']+)' is not in struct", first)
    if key and m:
        parent = key.rpartition(".")[0] or "the top level"
        return f"{key}: no such key in {parent}; check the spelling (python train.py --cfg job prints every key)"
    m = re.search(r"Could not find '([^']+)'", str(exc))
    if m:
        group = m.group(1).rpartition("/")[0]
        options = re.findall(r"^\t(\S+)$", str(exc).split("Config search path")[0], flags=re.M)
        # the user's folders beside the shipped conf/ (provider=main): --config-dir, hydra.searchpath, ./conf
        users = re.findall(r"^\tprovider=(?!main,|hydra,|schema,)[^,]*, path=file://(.+)$", str(exc), flags=re.M)
        folders = ", ".join(f"{u.rstrip('/')}/{group}/" for u in users)
        where = f" (looked in conf/{group}/, {folders})" if users else ""
        return (f"{group}={m.group(1).rpartition('/')[2]}: no such option{where}; allowed values are "
                f"{', '.join(options)}")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return "; ".join(lines[:2]) + (f": {first}" if cause is not exc else "")
