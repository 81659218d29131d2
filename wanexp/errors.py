"""User-input errors. A leaf module: everything in wanexp may import it; it imports nothing of wanexp.

Every subclass of :class:`UserError` carries a one-line message that names the bad input and what to change. The CLI
prints it as ``wanexp: error: <message>`` and exits 2; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """Base class of every error caused by the user's input (config, files, data), not by a bug."""


class ConfigError(UserError, ValueError):
    """A bad run configuration: the key, what is wrong, and what to change."""


class MetadataError(UserError, ValueError):
    """A metadata file is missing, malformed or incomplete."""


class MediaError(UserError, ValueError):
    """A media file cannot be read or is unsuitable for the request."""


class DivergedError(UserError, FloatingPointError):
    """Training produced a non-finite loss (usually a learning rate or precision the run cannot hold)."""


class Interrupted(SystemExit):
    """Not an error: the run stopped on a signal after saving a checkpoint; its exit code is 128 + the signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def say_error(line: str) -> None:
    """The one line of a refusal, on stderr. Under torchrun also in this rank's error file (TORCHELASTIC_ERROR_FILE):
    torchrun reports a worker that exits non-zero with its own ChildFailedError traceback whatever the exit code,
    and shows that file's text as the root cause (without it: a pointer to its docs)."""
    import os
    import sys

    print(f"wanexp: error: {line}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json
        import time

        message = {"message": line, "extraInfo": {"py_callstack": f"wanexp: error: {line}",
                                                  "timestamp": str(int(time.time()))}}  # torch's ErrorHandler's form
        try:
            with open(path, "w") as f:
                json.dump({"message": message}, f)
        except OSError:  # the line on stderr is what matters
            pass


def refuse(line: str) -> None:
    """:func:`say_error`, then exit 2: how a command ends on bad input."""
    import sys

    say_error(line)
    sys.exit(2)
