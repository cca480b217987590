"""The project's one user-facing error type, at the bottom of the import graph.

`core.config` re-exports it; it lives here so the torch-free arithmetic under `core.config`
(`core.parallel.stages`) can raise it without importing the config module.
"""


class ConfigError(ValueError):
    """A bad configuration, detected before launch. The message names the key."""
