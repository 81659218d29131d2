"""The config folders: the shipped ``conf/`` (``CONF_DIR``) and the user's own, whose group files
(``data/my_clips.yaml``, ``model/...``, ``experiment/...``) every command composing a run finds beside the shipped ones.

The user's folder is ``$WANEXP_CONFIG_DIR`` when set (it must exist), else ``./conf`` of the current folder when there
is one (the repository's own ``conf/``, when a command runs from the checkout, is the shipped folder and is not added
twice). It joins Hydra's search path after the shipped folder, as a ``hydra.searchpath`` override would: an option of
the user's with a name wanexp ships (``data/mbc_5k.yaml``) is not used, and a warning says so. Hydra's own
``--config-dir DIR`` (whose files come first) and ``hydra.searchpath=[file://DIR]`` keep working beside it.
"""
from __future__ import annotations

import os
from pathlib import Path

from wanexp.errors import ConfigError

ENV = "WANEXP_CONFIG_DIR"
SEARCHPATH = "hydra.searchpath"

# The configs ship inside the package (wanexp/conf: in a checkout a link to the repository's conf/, in a wheel a
# copy), so an installed wanexp-train finds them from any folder.
CONF_DIR = (Path(__file__).resolve().parents[1] / "conf").resolve()
if not CONF_DIR.is_dir():  # a checkout whose link was lost (e.g. copied without symlinks)
    CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def shipped_dir() -> Path:
    return CONF_DIR


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def user_config_dir(environ=os.environ, cwd: Path | None = None) -> Path | None:
    """The user's config folder (absolute), or None: ``$WANEXP_CONFIG_DIR``, else ``./conf`` if it is a folder and
    not the shipped one. A ``WANEXP_CONFIG_DIR`` that is not a folder is one line."""
    value = environ.get(ENV)
    if value:
        folder = Path(os.path.expanduser(value)).absolute()
        if not folder.is_dir():
            raise ConfigError(f"{ENV}={value}: no such folder; point it at the folder holding your config groups "
                              "(data/, model/, experiment/, ...) or unset it to use ./conf")
    else:
        folder = (cwd or Path.cwd()).absolute() / "conf"
        if not folder.is_dir():
            return None
    return None if _same(folder, shipped_dir()) else folder


def searchpath_dirs(overrides) -> list[Path]:
    """The folders a command line adds to Hydra's search path: ``hydra.searchpath=[file://DIR, ...]`` and Hydra's
    ``--config-dir DIR`` / ``-cd DIR`` (``pkg://`` entries have no folder)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, found = [str(a) for a in overrides], []
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--config-dir", "-cd"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value:
                found.append(Path(os.path.expanduser(value)).absolute())
        elif key == SEARCHPATH and eq:
            try:
                entries = OverridesParser.create().parse_override(arg).value()
            except Exception:  # Hydra reports a malformed override itself, in one line
                continue
            found += [Path(str(e)[len("file://"):]).absolute() for e in (entries or [])
                      if str(e).startswith("file://")]
    return found


def with_user_config_dir(overrides, environ=os.environ, cwd: Path | None = None) -> list[str]:
    """``overrides`` with the user's config folder on Hydra's search path: a ``hydra.searchpath`` override of the
    command line gets it appended, else one is added before the first override; unchanged when there is no such
    folder or the command line already names it."""
    args = [str(a) for a in overrides]
    folder = user_config_dir(environ, cwd)
    if folder is None or any(_same(folder, d) for d in searchpath_dirs(args)):
        return args
    entry = _quoted(f"file://{folder}")
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key == SEARCHPATH and eq:
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                entries = OverridesParser.create().parse_override(arg).value() or []
            except Exception:  # left as written: Hydra's own line names the problem
                return args
            args[i] = f"{SEARCHPATH}=[{','.join([*(_quoted(str(e)) for e in entries), entry])}]"
            return args
    # beside the other overrides: Hydra's argparse takes them as one positional group (flags may follow, not split it)
    at = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), 0)
    return [*args[:at], f"{SEARCHPATH}=[{entry}]", *args[at:]]


def _quoted(text: str) -> str:
    """A string as a quoted Hydra override value (any path: spaces, commas, quotes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def config_roots(overrides) -> list[Path]:
    """The folders options are looked up in, in Hydra's order for a group option: ``--config-dir`` first, the shipped
    ``conf/``, then the search path's folders (the user's config folder among them once
    :func:`with_user_config_dir` added it)."""
    args = [str(a) for a in overrides]
    first, rest = [], []
    for i, arg in enumerate(args):
        key = arg.partition("=")[0]
        if key in ("--config-dir", "-cd"):
            first += searchpath_dirs(args[i:i + 2] if "=" not in arg else [arg])
        elif key == SEARCHPATH:
            rest += searchpath_dirs([arg])
    roots: list[Path] = []
    for root in (*first, shipped_dir(), *rest):
        if not any(_same(root, r) or root == r for r in roots):
            roots.append(root)
    return roots


def shadowed_options(roots: list[Path]) -> list[str]:
    """``group/name.yaml`` files of the folders after the shipped one that have a shipped option's name (Hydra takes
    the first folder's file: theirs are not used)."""
    shipped = shipped_dir()
    if not any(_same(r, shipped) for r in roots):
        return []
    after = roots[[i for i, r in enumerate(roots) if _same(r, shipped)][0] + 1:]
    found = []
    for root in after:
        for f in sorted(root.glob("*/*.yaml")):
            if (shipped / f.parent.name / f.name).is_file():
                found.append(str(f))
    return found
