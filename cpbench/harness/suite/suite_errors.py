"""A suite's errors, all at once: each names the field, the value and the fix (one line each)."""

from __future__ import annotations

import re


def near(name: str, known) -> str:
    """" Did you mean `x`?" for the known name closest to a misspelt one (case aside), or ""."""
    import difflib

    by_lower = {str(k).lower(): k for k in known}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean `{by_lower[close[0]]}`?" if close else ""


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


def in_flags(error: ValueError, flags: dict[str, str]) -> ValueError:
    """A suite's error said in a command line's words, for a suite a command built from its flags (`flags`: suite
    field -> flag): "suite field `seq_lens` = 65536" reads "`--seq 65536`", a field named in a fix ("`cp_styles`",
    "world_size = 2") its flag, and "model_overrides = {k = v}" "--override k=v". A field no flag sets keeps its
    suite name; other text is left as it is."""
    def said(flag: str, value: str) -> str:
        value = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
        return flag if value == "True" else f"{flag} {value}"  # a switch is the flag alone

    def head(m: re.Match) -> str:
        return f"`{said(flags[m[1]], m[2])}`" if m[1] in flags else m[0]

    if not flags:
        return error
    text = re.sub(r"suite field `(\w+)` = ('[^']*'|[^:]+?)(?=: )", head, str(error))
    if "model_overrides" in flags:
        text = re.sub(r"model_overrides = \{(\w+) = ([^}]*)\}",
                      lambda m: f"{flags['model_overrides']} {m[1]}={'<value>' if m[2] == '...' else m[2]}", text)
    named = "|".join(map(re.escape, flags))
    text = re.sub(rf"`({named})`", lambda m: f"`{flags[m[1]]}`", text)
    text = re.sub(rf"\b({named}) = ('[^']*'|\"[^\"]*\"|[\w.-]+)", lambda m: said(flags[m[1]], m[2]), text)
    return ValueError(text)
