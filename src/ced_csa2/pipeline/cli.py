"""The argument parser of every command line (the CLIs, stages, studies and benchmarks): a bad argument is two lines.

argparse wraps its usage to the terminal's width, so a command with a dozen options answered a
misspelt one with up to ten lines before the one that says what is wrong.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose error is the usage on one line, then ``<prog>: error: <message>``; exit 2."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")
