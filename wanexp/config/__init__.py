"""Configuration: composition helpers and cross-group validation (runs before any weight loads)."""
from wanexp.config.errors import ConfigError

__all__ = ["ConfigError"]
