"""User-facing errors: one line, no traceback, CLI exit code 2."""


class TandemError(Exception):
    """An error caused by the user's input (bad file, bad flag, bad value).

    The CLI prints ``error: <message>`` and exits with code 2; the server maps it to HTTP 400.
    """


class ArtifactError(TandemError):
    """An artifact (profile, predictors, plan) is missing, corrupted or made for something else."""
