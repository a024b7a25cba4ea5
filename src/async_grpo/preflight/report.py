"""What preflight found: one `Problem` per bad input (the field, what is wrong, the fix), collected in a
`PreflightReport`; `PreflightError` carries them to the command line, which prints each as
`error: <field>: <message>. Fix: ...` and exits 2."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_grpo.config import ConfigError


@dataclass(frozen=True)
class Problem:
    """One bad input found before launch.

    Attributes:
        field: the config field (`section.name`, e.g. `optim.learning_rate`) or input it concerns.
        message: what is wrong (one sentence, without the fix).
        fix: what to change; None when `message` already ends with its own "Fix: ...".
    """

    field: str
    message: str
    fix: str | None = None

    def __str__(self) -> str:
        message = self.message.rstrip()
        if self.fix is None:
            return f"{self.field}: {message}"
        end = "" if message.endswith(("?", "!", ".")) else "."
        return f"{self.field}: {message}{end} Fix: {self.fix.rstrip('.')}."


class PreflightError(ConfigError):
    """A run's inputs failed preflight: a user error, shown without a traceback (exit code 2).

    Attributes:
        problems: every problem found, in check order.
    """

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass
class PreflightReport:
    """The outcome of `preflight`: what was checked, what was skipped (and why), and the problems.

    Attributes:
        target: where the run will execute ("local" or "cluster"), which decides the checks.
        checked: names of the checks that ran.
        skipped: "check: reason" for each check that could not or need not run here.
        problems: every problem found; empty when the run may start.
    """

    target: str
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise the problems found, all at once.

        Raises:
            PreflightError: at least one problem was found.
        """
        if self.problems:
            raise PreflightError(self.problems)
