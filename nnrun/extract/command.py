"""The `nnrun extract` subcommand: arguments and how they map onto `nnrun.extract`."""

from __future__ import annotations

import argparse
import sys

from nnrun.extract.defaults import DEFAULT_SHARD_TOKENS

_DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `nnrun extract`'s options: a job (--out with --model, --input, --module) or --verify DIR."""
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--out",
        help="output folder (created; an existing one is resumed, or extended when items were appended to its "
        "input); this or --verify is required",
    )
    mode.add_argument(
        "--verify",
        metavar="DIR",
        help="check every file of an extraction folder against its "
        "manifest (sizes, sha256, offsets) and exit; no job runs; this or --out is required",
    )
    parser.add_argument(
        "--model", help="checkpoint folder, hub id or bundled name (e.g. tiny-facts); required with --out"
    )
    parser.add_argument(
        "--input",
        help="prompts: .txt (one a line), .jsonl, .parquet, or a saved HF dataset folder; required with --out",
    )
    parser.add_argument(
        "--module",
        action="extend",
        nargs="+",
        dest="modules",
        metavar="PATH",
        help="HF module path, e.g. model.layers.6 or model.layers.6.mlp.input (repeatable); required with --out",
    )
    parser.add_argument(
        "--positions",
        choices=("all", "last"),
        default="all",
        help="all: store every token; last: only each prompt's last (default: all)",
    )
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="stored dtype (default: the model's)")
    parser.add_argument(
        "--max-length", type=int, default=None, help="longest prompt in tokens (default: the model's context length)"
    )
    parser.add_argument("--truncate", action="store_true", help="cut prompts longer than --max-length")
    parser.add_argument(
        "--text-field",
        metavar="NAME",
        default=None,
        help="the field of .jsonl/.parquet/dataset records that holds the prompt (default: 'prompt', "
        "else 'text', else the record's only string field)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="read at most N input items (default: all)"
    )
    parser.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="stop at the first bad item, or skip it and record it in the manifest (default: stop)",
    )
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="prompt tokens per shard")
    parser.add_argument("--no-resume", action="store_true", help="refuse to continue an existing output folder")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary line")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    engine.add_argument("--model-dtype", choices=_DTYPES, default=None, help="compute dtype (default: auto)")
    engine.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto", help="dummy: random weights from the model's config"
    )
    engine.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens per forward (max_num_batched_tokens; default: the engine's, 8192)",
    )
    engine.add_argument(
        "--forward-path",
        choices=("auto", "exact"),
        default="auto",
        help="exact: every prompt through the model's own HF forward (auto: only when the load-time "
        "probe finds the packed path differs from it)",
    )
    scale = parser.add_argument_group("many engines (Ray; pip install 'nnrun[distributed]')")
    scale.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the job on Ray engines: the cluster at ADDRESS, else $RAY_ADDRESS, else a new local "
        "one; the folder is byte-identical to a single-process run (default: no Ray, this process)",
    )
    scale.add_argument(
        "--engines",
        type=int,
        default=None,
        metavar="N",
        help="engine actors with --ray (one GPU each where the cluster has GPUs; default 1); with "
        "--tensor-parallel-size N each engine holds N GPUs on one node and spawns its N ranks there",
    )
    scale.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="with --ray: a progress line per engine (tokens, tokens/s, ranges, restarts), moved as "
        "its forwards finish, and each engine's exact count at the end",
    )


def run(args: argparse.Namespace) -> int:
    """Run the job or the check; errors the user can fix print one line and exit 1 (2 for a usage error)."""
    job_options = {"--model": args.model, "--input": args.input, "--module": args.modules}
    if args.verify is not None:
        given = [flag for flag, value in job_options.items() if value is not None]
        if given:
            return _usage_error(f"--verify checks a folder and runs no job; leave out {', '.join(given)}")
        return verify(args.verify, args.quiet)
    missing = [flag for flag, value in job_options.items() if value is None]
    if missing:
        return _usage_error(f"extracting into --out needs {', '.join(missing)}")
    if args.ray is None and (args.engines is not None or args.verbose):
        return _usage_error("--engines and --verbose apply to a job on Ray: add --ray [ADDRESS]")
    return _run_job(args)


def verify(out_dir: str, quiet: bool = False) -> int:
    """`nnrun extract --verify DIR`: 0 when every file matches the manifest; otherwise name each bad one, exit 1."""
    from nnrun.extract.store import load_activations
    from nnrun.extract.verify import DamagedFolderError

    try:
        store = load_activations(out_dir, verify=True)
    except DamagedFolderError as error:
        for damage in error.damage:
            print(f"nnrun extract: {out_dir}: {damage.message()}", file=sys.stderr)
        print(f"nnrun extract: {out_dir} is damaged ({len(error.damage)} problems). {error.advice}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:  # no manifest, or one that is not JSON
        print(f"nnrun extract: error: {error}", file=sys.stderr)
        return 1
    if not quiet:
        state = "complete" if store.is_complete else "incomplete (a job can resume it)"
        print(
            f"{out_dir}: intact: {store.num_shards} shards, {len(store)} prompts, {store.num_tokens} tokens, "
            f"{len(store.skipped)} skipped items; {state}"
        )
    return 0


def _usage_error(message: str) -> int:
    print(f"nnrun extract: error: {message}", file=sys.stderr)
    return 2  # argparse's exit status for a usage error


def _run_job(args: argparse.Namespace) -> int:
    from nnrun.extract.executors import extract

    llm_kwargs = {
        "device": args.device,
        "dtype": args.model_dtype,
        "load_format": args.load_format,
        "forward_path": args.forward_path,
    }
    if args.batch_tokens is not None:
        llm_kwargs["max_num_batched_tokens"] = args.batch_tokens
    tp_size = getattr(args, "tensor_parallel_size", 1)  # added to every subcommand by nnrun.cli
    if tp_size > 1:
        llm_kwargs["tensor_parallel_size"] = tp_size
    try:
        summary = extract(
            args.model,
            args.input,
            args.modules,
            args.out,
            positions=args.positions,
            dtype=args.dtype,
            max_length=args.max_length,
            truncate=args.truncate,
            on_error=args.on_error,
            text_field=args.text_field,
            limit=args.limit,
            shard_tokens=args.shard_tokens,
            resume=not args.no_resume,
            progress=not args.quiet,
            llm_kwargs=llm_kwargs,
            **_executor_options(args),
        )
    except (ValueError, OSError) as error:  # InputError, SettingsMismatchError, DamagedFolderError, ShardWriteError
        print(f"nnrun extract: error: {error}", file=sys.stderr)
        return 1
    return 0 if summary.is_complete else 1


def _executor_options(args: argparse.Namespace) -> dict:
    if args.ray is None:
        return {}
    return {"executor": "ray", "num_engines": args.engines, "ray_address": args.ray or None, "verbose": args.verbose}
