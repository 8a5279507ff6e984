"""The legacy launcher: ``python -m distcomm.launch``, as ``torch.distributed.launch``.

::

    python -m distcomm.launch --nproc_per_node=2 [--nnodes=1 --node_rank=0 --master_addr=127.0.0.1
        --master_port=29500] [--use_env] train.py --arg1 ...

It is ``distcomm-run`` (every option of it is accepted, see ``distcomm.run``) with one difference:
each worker is passed ``--local_rank=<LOCAL_RANK>`` before the script's own arguments, unless
``--use_env`` is given, in which case the local rank is only in the LOCAL_RANK environment variable
(like every other variable of ``distcomm.run``'s environment contract, which is set either way).
"""

from __future__ import annotations

import sys
from typing import Sequence

from .run import get_args_parser, run

__all__ = ["main", "parse_args"]


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
    flags = {"--use_env", "--use-env", "--standalone", "-m", "--module", "--no-python", "--no_python"}
    return option.startswith("-") and "=" not in option and option not in flags


def parse_args(argv: Sequence[str] | None = None):
    parser = get_args_parser(prog="python -m distcomm.launch")
    parser.add_argument(
        "--use-env", "--use_env", action="store_true",
        help="Pass the local rank only in LOCAL_RANK instead of as --local_rank=<N> "
             "(--use_env=True is accepted too).",
    )
    return parser.parse_args(_normalize_use_env(sys.argv[1:] if argv is None else argv))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.use_env:
        print(
            "distcomm.launch: note: passing --local_rank=<N> to each worker, as "
            "torch.distributed.launch did; distcomm-run sets LOCAL_RANK instead (or use --use_env)",
            file=sys.stderr,
        )
    sys.exit(run(args, local_rank_arg=None if args.use_env else "--local_rank"))


if __name__ == "__main__":
    main()
