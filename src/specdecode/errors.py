class SpecDecodeError(ValueError):
    """A user-facing error: bad input, missing or corrupt model files, incompatible models.

    The CLI prints its message on one line and exits with status 2.
    """


def positive_int(name: str, value):
    """`value` where it is an integer of at least 1 (a bool is not one); SpecDecodeError naming `name` otherwise.
    Here, beside the error it raises, so that any module (the datastore, the load test) can use it without a cycle;
    checks.py hands it on."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecDecodeError(f"{name} must be a positive integer, got {value!r}")
    return value


class Interrupted(Exception):
    """A generation was asked to end while it read its prompt (its client is gone, or its deadline passed)."""
