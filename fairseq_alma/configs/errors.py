"""The one exception type of the config layer.

Every user mistake in a run config, resource profile or sweep directory becomes a ``ConfigError``
whose message is a single line naming the file and the key or flag and saying what to do; the
CLIs print it without a traceback (project standard for user errors).
"""


class ConfigError(ValueError):
    """A user-facing, one-line problem with a config file, profile or command-line value."""
