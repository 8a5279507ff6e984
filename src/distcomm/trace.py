"""``python -m distcomm.trace DIR``: read every rank's flight recorder dump and say who is behind, and
where.

    $ python -m distcomm.trace /tmp/trace
    group '0' (ranks 0,1,2):
      ranks 0,1 in all_reduce #6 (train.py:41) for 2.0 s
      rank 2 last completed all_reduce #5 (train.py:41) and has not started #6

It also reports the first divergence: the first sequence number of a group at which ranks called
different things (another op, size, dtype or root), with each side's call site.

``analyze`` is a pure function over parsed dumps (``{rank: (header, records)}``, as
``flight_recorder.read_dump`` returns them); ``main`` is the command line around it. A file that is
not a whole dump (empty, cut short, not this format) is skipped with a note naming it and what is
wrong: a post-mortem tool reports on the dumps it has.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Collection, Sequence

from .flight_recorder import COMPLETED, FAILED, FILE_PATTERN, SCHEDULED, STARTED, read_dump

Dumps = dict  # rank -> (header: dict, records: list[dict])


def _site(rec: dict) -> str:
    site = rec.get("site")
    return f"{os.path.basename(site['file'])}:{site['line']}" if site else "?"


def _ranks(ranks: Sequence[int]) -> str:
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, sorted(ranks)))


def _op(rec: dict) -> str:
    return f"{rec['op']} #{rec['seq']} ({_site(rec)})"


def _call(rec: dict) -> str:
    """What a rank called, in the terms ranks must agree on."""
    text = rec["op"]
    details = []
    if rec.get("nbytes") is not None:
        details.append(f"{rec['nbytes']} B")
    if rec.get("dtype"):
        details.append(rec["dtype"])
    if rec.get("peer") is not None:
        details.append(f"root {rec['peer']}")
    return text + (f" ({', '.join(details)})" if details else "")


def _key(rec: dict) -> tuple:
    return (rec["op"], rec.get("nbytes"), rec.get("dtype"), rec.get("peer"))


def _members(dumps: Dumps, group: str) -> list[int]:
    for header, _ in dumps.values():
        info = header.get("groups", {}).get(group)
        if info:
            return list(info["ranks"])
    return sorted(dumps)


def first_divergence(by_rank: dict[int, dict[int, dict]]) -> str | None:
    """The first sequence number at which ranks' records disagree, described; None if none do."""
    seqs = sorted(set().union(*[set(recs) for recs in by_rank.values()])) if by_rank else []
    for seq in seqs:
        calls: dict[tuple, list[int]] = {}
        sample: dict[tuple, dict] = {}
        for rank, recs in sorted(by_rank.items()):
            rec = recs.get(seq)
            if rec is not None:
                calls.setdefault(_key(rec), []).append(rank)
                sample.setdefault(_key(rec), rec)
        if len(calls) > 1:
            parts = [f"{_ranks(rs)} called {_call(sample[k])} at {_site(sample[k])}" for k, rs in calls.items()]
            return f"first divergence at #{seq}: " + "; ".join(parts)
    return None


def analyze_group(dumps: Dumps, group: str, unreadable: Collection[int] = ()) -> list[str]:
    members = _members(dumps, group)
    lines = [f"group {group!r} (ranks {','.join(map(str, members))}):"]
    by_rank: dict[int, dict[int, dict]] = {}
    p2p_pending: list[str] = []
    for rank in members:
        if rank not in dumps:
            continue
        recs = {}
        for rec in dumps[rank][1]:
            if rec.get("group") != group:
                continue
            if rec.get("seq") is None:  # a send or receive: no sequence number to line up
                if rec.get("state") in (SCHEDULED, STARTED):
                    p2p_pending.append(f"rank {rank} {rec['op']} with rank {rec.get('peer')} tag {rec.get('tag')} "
                                       f"({_site(rec)}) has not completed")
                continue
            recs[rec["seq"]] = rec
        by_rank[rank] = recs
    missing = [r for r in members if r not in dumps]
    latest = max((max(recs) for recs in by_rank.values() if recs), default=None)
    if latest is None:
        lines.append("  no collective recorded")
    else:
        in_flight: dict[tuple, list[int]] = {}
        failed: dict[tuple, list[int]] = {}
        behind: dict[tuple, list[int]] = {}
        done: dict[tuple, list[int]] = {}
        sample: dict[tuple, dict] = {}
        for rank, recs in sorted(by_rank.items()):
            if not recs:
                behind.setdefault(("none",), []).append(rank)
                continue
            last = recs[max(recs)]
            completed = [s for s, r in recs.items() if r.get("state") == COMPLETED]
            last_done = recs[max(completed)] if completed else None
            if last.get("state") in (SCHEDULED, STARTED):
                # a rank may have several queued (async) calls: report the oldest not completed
                oldest = min(s for s, r in recs.items() if r.get("state") in (SCHEDULED, STARTED))
                key = ("in", recs[oldest]["op"], oldest, _site(recs[oldest]))
                in_flight.setdefault(key, []).append(rank)
                sample[key] = recs[oldest]
            elif last.get("state") == FAILED:
                error = last.get("error") or "?"
                key = ("failed", last["op"], last["seq"], _site(last), error.split(":")[0])
                failed.setdefault(key, []).append(rank)
                sample.setdefault(key, last)
            elif last["seq"] < latest:
                key = ("behind", _op(last_done) if last_done else None, last["seq"])
                behind.setdefault(key, []).append(rank)
            else:
                key = ("done", _op(last))
                done.setdefault(key, []).append(rank)
        for key, ranks in in_flight.items():
            rec = sample[key]
            waited = ""
            header_time = max(dumps[r][0].get("time", 0) for r in ranks)
            if header_time and rec.get("time_created"):
                waited = f" for {header_time - rec['time_created']:.1f} s"
            lines.append(f"  {_ranks(ranks)} in {_op(rec)}{waited}")
        for key, ranks in failed.items():
            # one rank: its error's first line; several: their error type (each text names its rank)
            rec = sample[key]
            lines.append(f"  {_ranks(ranks)} failed in {_op(rec)}: {rec.get('error') if len(ranks) == 1 else key[4]}")
        for key, ranks in done.items():
            lines.append(f"  {_ranks(ranks)} completed {key[1]}")
        for key, ranks in behind.items():
            if key == ("none",):
                lines.append(f"  {_ranks(ranks)} recorded no collective of this group")
                continue
            verb = "have" if len(ranks) > 1 else "has"
            lines.append(f"  {_ranks(ranks)} last completed {key[1] or 'nothing'} and {verb} not started "
                         f"#{key[2] + 1}")
        if not in_flight and not failed and not behind:
            lines.append("  no rank is behind")
        divergence = first_divergence(by_rank)
        if divergence:
            lines.append("  " + divergence)
    bad = [r for r in missing if r in unreadable]
    missing = [r for r in missing if r not in unreadable]
    if bad:
        lines.append(f"  {_ranks(bad)}: dump unreadable (skipped)")
    if missing:
        lines.append(f"  {_ranks(missing)}: no dump (dead, stopped, or DISTCOMM_TRACE_DIR unset there)")
    lines.extend("  " + line for line in p2p_pending)
    return lines


def analyze(dumps: Dumps, unreadable: Collection[int] = ()) -> list[str]:
    """Lines saying, per group, who is behind and where, and the first divergence (if any).
    ``unreadable``: ranks whose dump file exists but could not be read (``load``'s ``skipped``)."""
    groups: list[str] = []
    for _, (header, records) in sorted(dumps.items()):
        for name in list(header.get("groups", {})) + [r.get("group") for r in records]:
            if name is not None and name not in groups:
                groups.append(name)
    lines = []
    for group in groups:
        lines.extend(analyze_group(dumps, group, unreadable))
    reasons = {h.get("reason") for h, _ in dumps.values() if h.get("reason")}
    if reasons:
        lines.append("dumped because: " + "; ".join(sorted(reasons)))
    return lines


def _rank_of_name(path: str) -> int | None:
    """The rank in a dump file's name (distcomm_trace_rank_<rank>.jsonl), or None."""
    text = os.path.basename(path)[len(FILE_PATTERN.split("{")[0]):-len(FILE_PATTERN.split("}")[1])]
    return int(text) if text.isdigit() else None


def load(directory: str, skipped: list[tuple[str, str, int | None]] | None = None) -> Dumps:
    """Every rank's readable dump in ``directory``. A file that is not one is left out, and, if
    ``skipped`` is given, listed there as (path, what is wrong, the rank its name says or None)."""
    dumps: Dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, FILE_PATTERN.format(rank="*")))):
        try:
            header, records = read_dump(path)
            rank = header.get("rank")
            if rank is None:
                rank = _rank_of_name(path)
            elif isinstance(rank, str) and rank.isdigit():
                rank = int(rank)
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError(f"no rank in its header or name (rank {rank!r})")
        except (OSError, ValueError) as exc:
            if skipped is not None:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                skipped.append((path, why, _rank_of_name(path)))
            continue
        dumps[rank] = (header, records)
    return dumps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the DISTCOMM_TRACE_DIR the ranks dumped to")
    args = parser.parse_args(argv)
    skipped: list[tuple[str, str, int | None]] = []
    dumps = load(args.directory, skipped)
    for path, why, _ in skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    if not dumps:
        if skipped:
            print(f"none of the {len(skipped)} flight recorder dumps in {args.directory} could be read", file=sys.stderr)
        else:
            print(f"no flight recorder dumps (distcomm_trace_rank_*.jsonl) in {args.directory}", file=sys.stderr)
        return 1
    unreadable = {rank for _, _, rank in skipped if rank is not None and rank not in dumps}
    print("\n".join(analyze(dumps, unreadable)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
