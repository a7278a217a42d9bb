class SpecDecodeError(ValueError):
    """A user-facing error: bad input, missing or corrupt model files, incompatible models.

    The CLI prints its message on one line and exits with status 2.
    """
