"""The error every configuration check raises, at the bottom of the package so that every layer (models, parallel,
plan, config) can raise it without importing what validates a whole config."""


class ConfigError(ValueError):
    """A configuration whose values do not fit together; the message starts with the key."""
