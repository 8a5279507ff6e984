"""The legacy launcher: ``python -m distcomm.launch``, as ``torch.distributed.launch`` (torch 2.13).

::

    python -m distcomm.launch --nproc-per-node=2 [--nnodes=1 --node-rank=0 --master-addr=127.0.0.1
        --master-port=29500] [--use-env] train.py --arg1 ...

It is ``distcomm-run`` (every option of it is accepted, see ``distcomm.run``) with the two
differences torch's has:

- each worker is passed ``--local-rank=<LOCAL_RANK>`` (dashed, as torch >= 2.0 passes it) before
  the script's own arguments, unless ``--use-env``/``--use_env`` is given, in which case the local
  rank is only in the LOCAL_RANK environment variable (set either way). Scripts should accept both
  spellings, as torch's docs advise: ``parser.add_argument("--local-rank", "--local_rank", type=int)``;
- ``main()`` is deprecated in favour of ``distcomm-run``: calling it emits the FutureWarning
  torch's does (same text with distcomm's names, via ``warnings.warn(..., stacklevel=2)`` like
  ``typing_extensions.deprecated``, so it is shown by default and can be filtered the usual way).

``--no-python`` without ``--use-env`` is refused with torch's ValueError (a program that is not
Python cannot be assumed to parse ``--local-rank``). One superset: ``--use_env=True``/``=False``
(the seed's spelling) is accepted too; torch's argparse would reject it.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Sequence

from .run import get_args_parser, run

__all__ = ["main", "parse_args", "launch"]

LOCAL_RANK_ARG = "--local-rank"

_DEPRECATION = (
    "The module distcomm.launch is deprecated\n"
    "and will be removed in future. Use distcomm-run.\n"
    "Note that --use-env is set by default in distcomm-run.\n"
    "If your script expects `--local-rank` argument to be set, please\n"
    "change it to read from `os.environ['LOCAL_RANK']` instead. See \n"
    "https://pytorch.org/docs/stable/distributed.html#launch-utility for \n"
    "further instructions\n"
)


def _deprecated(message: str):
    """What ``typing_extensions.deprecated(message, category=FutureWarning)`` does to a function
    (distcomm does not depend on typing_extensions): warn at each call, at the caller's line."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            warnings.warn(message, category=FutureWarning, stacklevel=2)
            return fn(*args, **kwargs)

        wrapper.__deprecated__ = fn.__deprecated__ = message
        return wrapper

    return decorate


def _normalize_use_env(argv: Sequence[str]) -> list[str]:
    """``--use_env=True`` (the seed's spelling) -> ``--use_env``; ``=False`` drops it.

    Only options before the script are looked at: the script's own arguments are left alone.
    """
    out, before_script = [], True
    for arg in argv:
        name, sep, value = arg.partition("=")
        if before_script and sep and name in ("--use_env", "--use-env"):
            if value.lower() in ("1", "true", "yes"):
                out.append("--use_env")
            elif value.lower() not in ("0", "false", "no"):
                raise SystemExit(f"distcomm.launch: error: {arg}: expected True or False")
            continue
        if before_script and not arg.startswith("-") and out and not _takes_value(out[-1]):
            before_script = False
        out.append(arg)
    return out


def _takes_value(option: str) -> bool:
    flags = {"--use_env", "--use-env", "--standalone", "-m", "--module", "--no-python", "--no_python",
             "--rank-prefix", "--rank_prefix"}
    return option.startswith("-") and "=" not in option and option not in flags


def parse_args(argv: Sequence[str] | None = None):
    parser = get_args_parser(prog="python -m distcomm.launch")
    parser.add_argument(
        "--use-env", "--use_env", default=False, action="store_true",
        help="Use environment variable to pass 'local rank'. For legacy reasons, the default value "
             "is False. If set, the script is not passed --local-rank; it reads LOCAL_RANK.",
    )
    return parser.parse_args(_normalize_use_env(sys.argv[1:] if argv is None else argv))


def launch(args) -> int:
    """Run the parsed legacy options; the exit code."""
    if args.no_python and not args.use_env:
        raise ValueError("When using the '--no-python' flag, you must also set the '--use-env' flag.")
    return run(args, local_rank_arg=None if args.use_env else LOCAL_RANK_ARG)


@_deprecated(_DEPRECATION)
def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(launch(parse_args(argv)))


if __name__ == "__main__":
    main()
