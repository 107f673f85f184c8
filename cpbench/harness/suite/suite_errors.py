"""A suite's errors, all at once: each names the field, the value and the fix (one line each)."""

from __future__ import annotations


def err(field_name: str, value, fix: str) -> ValueError:
    return ValueError(f"suite field `{field_name}` = {value!r}: {fix}")


class SuiteErrors(ValueError):
    """Every error of a suite at once: one line each (field, value, fix); a repeated line is listed once."""

    def __init__(self, source, errors: list[str]):
        errors = list(dict.fromkeys(errors))
        self.errors = errors
        lines = errors if len(errors) > 1 else []
        head = f"{source}: {len(errors)} errors:" if len(errors) > 1 else f"{source}: {errors[0]}"
        super().__init__("\n".join([head, *(f"  - {e}" for e in lines)]))


class Collector:
    """Runs checks and keeps their errors instead of stopping at the first."""

    def __init__(self):
        self.errors: list[str] = []

    def run(self, check, *args):
        try:
            return check(*args)
        except ValueError as e:
            self.errors.extend(e.errors if isinstance(e, SuiteErrors) else [str(e)])
            return None

    def passes(self, check, *args) -> bool:
        """Runs `check`; True when it added no error."""
        before = len(self.errors)
        self.run(check, *args)
        return len(self.errors) == before

    def raise_any(self, source: str = "suite") -> None:
        if self.errors:
            raise SuiteErrors(source, self.errors)


def each(check, values, *args) -> None:
    """`check(value, *args)` for every value; raises the errors of all of them at once."""
    found = Collector()
    for value in values:
        found.run(check, value, *args)
    found.raise_any()
