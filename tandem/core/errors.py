"""User-facing errors: one line, no traceback, CLI exit code 2."""


class TandemError(Exception):
    """An error caused by the user's input (bad file, bad flag, bad value).

    The CLI prints ``error: <message>`` and exits with code 2; the server maps it to HTTP 400.
    """


class ArtifactError(TandemError):
    """An artifact (profile, predictors, plan) is missing, corrupted or made for something else."""


def check_int(name: str, value, minimum: int, optional: bool = True) -> None:
    """A TandemError naming ``name`` unless ``value`` is an integer (not a bool) of at least ``minimum``, or None
    where ``optional``.

    Example::

        check_int("threads", threads, 1)   # "threads must be an integer >= 1, got 0"
    """
    if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                or value < minimum):
        raise TandemError(f"{name} must be an integer >= {minimum}, got {value!r}")
