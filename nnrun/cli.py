"""The `nnrun` command line: one subcommand per job (`nnrun extract ...`, `nnrun serve ...`).

A subcommand is a module with `add_arguments(parser)` and `run(args) -> exit code`; adding one
is adding a line to SUBCOMMANDS. Arguments are parsed first and imported after: a subcommand's
module loads only when that subcommand is named, and declares its options without torch, so
`nnrun --help` and `nnrun <command> --help` answer at once; `run` imports what the job needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help says its default: "(default: X)" is added unless the text names it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        takes_value = action.option_strings and action.nargs != 0  # not a flag such as --quiet
        if not takes_value or "default" in help_text or action.default in (None, argparse.SUPPRESS):
            return help_text
        return f"{help_text} (default: %(default)s)"


# name -> (module with add_arguments and run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "extract": ("nnrun.extract.command", "store module activations of many prompts in shards"),
    "serve": ("nnrun.serve.command", "serve one engine to nnsight traces and OpenAI clients over HTTP"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with full options for the subcommands named in `argv`."""
    parser = argparse.ArgumentParser(
        prog="nnrun", description="nnrun: an interpretability runtime", formatter_class=HelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        sub.set_defaults(module_name=module_name)
        if name in argv:
            importlib.import_module(module_name).add_arguments(sub)
        sub.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help="ranks that share the model (tensor parallelism; default 1)",
        )
    return parser


def refuse_tensor_parallel(args: argparse.Namespace) -> str | None:
    """Why this command cannot run with `--tensor-parallel-size N` (None when it can)."""
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be a positive integer, got {args.tensor_parallel_size}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nnrun` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    refusal = refuse_tensor_parallel(args)
    if refusal is not None:
        print(f"nnrun: {refusal}", file=sys.stderr)
        return 2
    return importlib.import_module(args.module_name).run(args)


if __name__ == "__main__":
    sys.exit(main())
