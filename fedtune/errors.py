"""The one exception base of fedtune: every error a user can cause (a bad config, data file, run
folder, report input, deployment flag, or a round that failed) is a :class:`FedtuneError`, which
the CLI turns into one line and a non-zero exit. Anything else is a bug and keeps its traceback."""


class FedtuneError(Exception):
    """An error whose message is the whole story for the user (one line, naming the culprit).
    ``exit_code``: 2 for bad input (the default), 1 for a run or deployment that failed."""

    exit_code = 2
