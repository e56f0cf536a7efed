"""The `nnrun extract` subcommand: arguments and how they map onto `nnrun.extract`."""

from __future__ import annotations

import argparse
import sys

from nnrun.extract.job import DEFAULT_SHARD_TOKENS

_DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `nnrun extract`'s options."""
    parser.add_argument("--model", required=True, help="checkpoint folder, hub id or bundled name (e.g. tiny-facts)")
    parser.add_argument("--input", required=True,
                        help="prompts: .txt (one a line), .jsonl, .parquet, or a saved HF dataset folder")
    parser.add_argument("--module", action="extend", nargs="+", required=True, dest="modules", metavar="PATH",
                        help="HF module path, e.g. model.layers.6 or model.layers.6.mlp.input (repeatable)")
    parser.add_argument("--out", required=True, help="output folder (created; an existing one is resumed)")
    parser.add_argument("--positions", choices=("all", "last"), default="all",
                        help="store every token (default) or only each prompt's last")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="stored dtype (default: the model's)")
    parser.add_argument("--max-length", type=int, default=None, help="longest prompt in tokens")
    parser.add_argument("--truncate", action="store_true", help="cut prompts longer than --max-length")
    parser.add_argument("--text-field", default="text", help="text field of .jsonl/.parquet/dataset records")
    parser.add_argument("--limit", type=int, default=None, help="read at most N input items")
    parser.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                        help="stop at the first bad item (default), or skip it and record it in the manifest")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="prompt tokens per shard")
    parser.add_argument("--no-resume", action="store_true", help="refuse to continue an existing output folder")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--model-dtype", choices=_DTYPES, default=None, help="compute dtype (default: auto)")
    engine.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: random weights from the model's config")
    engine.add_argument("--batch-tokens", type=int, default=None, help="tokens per forward (max_num_batched_tokens)")


def run(args: argparse.Namespace) -> int:
    """Run the job; errors the user can fix print one line and exit 1."""
    from nnrun.extract.job import extract

    llm_kwargs = {"device": args.device, "dtype": args.model_dtype, "load_format": args.load_format}
    if args.batch_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.batch_tokens
    try:
        summary = extract(
            args.model, args.input, args.modules, args.out, positions=args.positions, dtype=args.dtype,
            max_length=args.max_length, truncate=args.truncate, on_error=args.on_error, text_field=args.text_field,
            limit=args.limit, shard_tokens=args.shard_tokens, resume=not args.no_resume, progress=not args.quiet,
            llm_kwargs=llm_kwargs,
        )
    except (ValueError, OSError) as error:  # InputError, SettingsMismatchError, ShardWriteError, FileExistsError
        print(f"nnrun extract: error: {error}", file=sys.stderr)
        return 1
    return 0 if summary.is_complete else 1
