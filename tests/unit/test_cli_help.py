"""The command line explains itself: every argument of every subcommand has help, and a default a user relies on is
stated where it is chosen (`sweep`'s suite, `estimate --styles`)."""

from __future__ import annotations

import argparse

from cpbench.cli import build_parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_argument_has_help():
    missing = [f"{name} {action.dest}" for name, sub in _subcommands().items() for action in sub._actions
               if not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing, f"arguments without help: {missing}"


def test_defaults_users_rely_on_are_stated():
    subs = _subcommands()
    assert "'default'" in subs["sweep"].format_help()
    from cpbench.harness.estimate_cli import QUICK_DEFAULTS

    styles = next(a for a in subs["estimate"]._actions if a.dest == "styles")
    assert styles.default is None  # a suite file keeps its own; the quick form's default is in the help
    assert ",".join(QUICK_DEFAULTS["cp_styles"]) in styles.help.replace(" ", "")
    model = next(a for a in subs["estimate"]._actions if a.dest == "model")
    assert "config.json" in model.help and "directory" in model.help
