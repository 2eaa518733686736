"""User-facing errors: the CLI prints these as one line, without a traceback."""


class KVShotError(Exception):
    """A problem with the user's input (a file, a flag, a config) that they can fix."""
