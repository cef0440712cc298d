"""One exception type for every user mistake: it names the field and the fix."""

from __future__ import annotations


class LogprobeError(ValueError):
    """Bad input or an unusable model. ``field`` names what was wrong, ``fix`` what to do.

    The CLI prints ``str(err)`` on one line and exits non-zero; the server answers 4xx with it.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)


class WeightsUnavailable(LogprobeError):
    """The weights cannot be scored now: an in-place update (``update_weights(..., in_place=True)``,
    a group joined ``in_place``) is writing them, or failed part way and left them part old, part
    new. Scoring is refused until an update completes; the server answers 503 with ``Retry-After``."""


def check_positive_ints(obj: object, names: tuple[str, ...]) -> None:
    """Config validation: each named attribute must be an int >= 1 (a bool is not an int here)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LogprobeError(name, f"must be a positive integer, got {value!r}")
