"""The ``maxdiff`` command line: ``generate`` images from prompts, ``info`` on a model,
``convert`` a checkpoint to a dtype.

The package: the parser (``parser``), the commands (``generate``, ``info``, ``convert``) and
what they share (``common``). ``maxdiff generate`` validates every prompt line before it loads
anything, groups images by shape (size, steps, guidance on/off) so each compiled program is
reused, fills device batches across prompts, and writes each image atomically with a
``metadata.jsonl`` line; rerunning the same command resumes (:mod:`pipelines.cli.prompts`).

Exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 128+N killed by signal N (143 for
SIGTERM, 130 for Ctrl-C); an interrupted run keeps every finished image.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

from pipelines.cli.common import Interrupted, _on_signal
from pipelines.cli.convert import cmd_convert
from pipelines.cli.generate import cmd_generate
from pipelines.cli.info import cmd_info
from pipelines.cli.lines import InputError
from pipelines.cli.parser import PROG, build_parser


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    command = {"generate": cmd_generate, "info": cmd_info, "convert": cmd_convert}[args.command]
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        return command(args)
    except InputError as e:
        for msg in e.errors:
            print(f"{PROG} {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"{PROG} {args.command}: interrupted by {signal.Signals(e.signum).name}",
              file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("MAXDIFF_DEBUG"):
            traceback.print_exc()
        print(f"{PROG} {args.command}: error: {type(e).__name__}: {e} "
              "(set MAXDIFF_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


__all__ = ["main", "build_parser"]
