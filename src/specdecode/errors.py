class SpecDecodeError(ValueError):
    """A user-facing error: bad input, missing or corrupt model files, incompatible models.

    The CLI prints its message on one line and exits with status 2.
    """


class Interrupted(Exception):
    """A generation was asked to end while it read its prompt (its client is gone, or its deadline passed)."""
