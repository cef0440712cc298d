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
