class ConfigError(ValueError):
    """A bad setting: the message names the setting and the fix."""
