"""The errors a user's own input causes, which scripts report without a traceback.

``UsageError`` is a user's mistake: a flag value, a combination of flags the recipe cannot
run, a missing or malformed file, an unknown model. Its message names the flag, file or value
and what to do; the training scripts print it in one or two lines and exit 2 (``--debug``
shows the traceback). Anything else that escapes a script is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["NonFiniteError", "UsageError"]


class UsageError(Exception):
    """A user's mistake; the message says what was wrong and what to do instead."""


class NonFiniteError(UsageError):
    """Training produced a non-finite loss or weights: the run stops, naming the step and the
    flag most likely at fault (the learning rate, fp16 without loss scaling...)."""
