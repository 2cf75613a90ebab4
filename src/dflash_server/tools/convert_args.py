"""``dflash-serve convert``'s flags, in a module that imports nothing heavy: ``dflash-serve``
parses them before it imports the conversion (``convert.py``), so ``--help`` and a mistyped flag
answer at once."""

from __future__ import annotations

import argparse

from dflash_server.cli_parser import Parser

DTYPE_NAMES = ["bfloat16", "float16", "float32"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dflash-serve convert",
        description="Quantize and/or cast a DFlash drafter (hub id or folder) into a new folder.",
    )
    p.add_argument("source", help="drafter: HF repo id or local folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true", help="write into an --out that holds files")
    p.add_argument("--q-bits", type=int, choices=[4, 5, 6, 8], help="quantize to this many bits")
    p.add_argument("--q-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="cast floating weights first")
    p.add_argument("--target", help="target model; measures the block-logit error vs the source")
    p.add_argument("--sample-file", help="text file for the logit-error sample (default: built-in)")
    p.add_argument(
        "--mtp", action="store_true",
        help="SOURCE is a target checkpoint (or MTP folder): write its MTP head as a split "
        "export, for a target conversion that dropped mtp.*",
    )  # fmt: skip
    return p
