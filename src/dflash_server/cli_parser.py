"""The argument parser of every ``dflash-serve`` command: a mistyped flag is one short line that
names the flag it was probably meant to be, not the usage of every flag. Standard library only,
so that each command's ``--help`` answers at once."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import NoReturn

UNRECOGNIZED = "unrecognized arguments: "


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the known name closest to ``word``, or ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, with a guess for unknown flags."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self._guesses(message)} (see {self.prog} "
                     "--help)\n")  # fmt: skip

    def _guesses(self, message: str) -> str:
        if not message.startswith(UNRECOGNIZED):
            return ""
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        words = [w.split("=", 1)[0] for w in message[len(UNRECOGNIZED) :].split()]
        return "".join(did_you_mean(w, flags) for w in words if w.startswith("--"))
