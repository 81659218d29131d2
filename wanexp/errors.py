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
