"""The error every configuration check raises: it names the key that does not fit."""


class ConfigError(ValueError):
    """A configuration whose values do not fit together; the message starts with the key."""
