class ConfigError(ValueError):
    """A bad run configuration. The message is one line: the key, what is wrong, and what to change."""
