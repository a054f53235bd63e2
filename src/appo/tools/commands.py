"""CLI: `appo search ...` (index, query, cache import/export/stats, pages build) and
`appo tool python`.

Import-light: handlers import bm25s, numpy and the sandbox only when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from appo.cli_args import positive_float, positive_int
from appo.errors import AppoError


def register(sub) -> None:
    search = sub.add_parser("search", help="local search index, queries, and the search cache")
    ssub = search.add_subparsers(dest="search_command", metavar="SUBCOMMAND")
    search.set_defaults(handler=lambda args: _help(search))

    p = ssub.add_parser("index", help="build a bm25 index from a JSONL corpus {id, title, text}")
    p.add_argument("corpus", help="JSONL passages, or the original's search_cache.json")
    p.add_argument("--out", required=True, help="index directory to write")
    p.set_defaults(handler=cmd_index)

    p = ssub.add_parser("query", help="run one search the way the search tool would")
    p.add_argument("text")
    p.add_argument("--backend", default=None, help="bm25 | replay | brightdata | http")
    p.add_argument("--config", default=None,
                   help="take tools.tool_instances.search.params from this config file")
    p.add_argument("--corpus", default=None)
    p.add_argument("--index-dir", default=None)
    p.add_argument("--replay-file", default=None)
    p.add_argument("--url", default=None)
    p.add_argument("--zone", default=None)
    p.add_argument("--max-results", type=positive_int, default=None)
    p.add_argument("--result-length", type=positive_int, default=None)
    p.add_argument("--cache-file", default=None)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--miss-policy", default=None, help="live | fail")
    p.add_argument("--json", action="store_true", help="print the whole result record")
    p.set_defaults(handler=cmd_query)

    cache = ssub.add_parser("cache", help="import / export / inspect the search cache")
    csub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    cache.set_defaults(handler=lambda args: _help(cache))
    for action, helptext in [("import", "import an original-format {query: text} JSON file"),
                             ("export", "export entries as original-format JSON")]:
        p = csub.add_parser(action, help=helptext)
        p.add_argument("file")
        p.add_argument("--cache-file", default=None, help="SQLite cache (default: $APPO_CACHE)")
        p.add_argument("--backend", default="brightdata" if action == "import" else None,
                       help="backend the entries belong to (import default: brightdata, the "
                            "original's)")
        if action == "import":
            p.add_argument("--max-results", type=positive_int, default=10,
                           help="max_results the entries were recorded with (key part)")
            p.add_argument("--result-length", type=positive_int, default=1000,
                           help="result_length the entries were recorded with (key part)")
            p.add_argument("--overwrite", action="store_true",
                           help="replace entries that already exist")
        p.set_defaults(handler=cmd_cache_import if action == "import" else cmd_cache_export)
    p = csub.add_parser("stats", help="entry count, per backend")
    p.add_argument("--cache-file", default=None)
    p.set_defaults(handler=cmd_cache_stats)

    pages = ssub.add_parser("pages", help="the deep-search page store")
    psub = pages.add_subparsers(dest="pages_command", metavar="ACTION")
    pages.set_defaults(handler=lambda args: _help(pages))
    p = psub.add_parser("build", help="build a page store (url -> text) from a search corpus: "
                                      "passages of one page (same url, else same title) joined")
    p.add_argument("corpus", help="JSONL passages {id, title, text[, url]}")
    p.add_argument("--out", required=True,
                   help="page store to write: .jsonl ({url, text} lines) or SQLite (other names)")
    p.set_defaults(handler=cmd_pages_build)

    tool = sub.add_parser("tool", help="run a tool by hand")
    tsub = tool.add_subparsers(dest="tool_command", metavar="TOOL")
    tool.set_defaults(handler=lambda args: _help(tool))
    p = tsub.add_parser("python", help="run code in the sandbox; print what the model would "
                                       "see inside <result>")
    p.add_argument("code", help="Python code, or - to read it from stdin")
    p.add_argument("--timeout", type=positive_float, default=10.0)
    p.add_argument("--memory-mb", type=positive_int, default=1024)
    p.add_argument("--isolation", default="auto", help="auto | rlimits")
    p.add_argument("--verbose", action="store_true",
                   help="also print status, latency and active isolation layers to stderr")
    p.set_defaults(handler=cmd_tool_python)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def cmd_index(args) -> int:
    from pathlib import Path

    from appo.tools.search_backends import Bm25Index, file_fingerprint, load_passages

    start = time.monotonic()
    passages = load_passages(args.corpus)
    index = Bm25Index.build(passages, args.out, fingerprint=file_fingerprint(args.corpus))
    print(f"indexed {len(index.passages)} passages from {args.corpus} into "
          f"{Path(args.out)} in {time.monotonic() - start:.1f} s")
    return 0


def cmd_pages_build(args) -> int:
    from appo.tools.pages import build_page_store

    n = build_page_store(args.corpus, args.out)
    print(f"wrote {n} pages from {args.corpus} to {args.out}")
    return 0


def _search_params(args) -> dict:
    params: dict = {}
    if args.config:
        from appo.config import load_config, to_container

        cfg = load_config(args.config)
        inst = cfg.tools.tool_instances.get("search")
        if inst is None:
            raise AppoError(f"{args.config} has no tools.tool_instances.search")
        params.update(to_container(inst.params))
    flags = {"backend": args.backend, "corpus": args.corpus, "index_dir": args.index_dir,
             "replay_file": args.replay_file, "url": args.url, "zone": args.zone,
             "max_results": args.max_results, "result_length": args.result_length,
             "cache_file": args.cache_file, "miss_policy": args.miss_policy}
    params.update({k: v for k, v in flags.items() if v is not None})
    if args.no_cache:
        params["cache"] = False
    return params


def cmd_query(args) -> int:
    from appo.tools.search_tool import SearchTool

    tool = SearchTool(**_search_params(args))
    try:
        result = tool.execute(args.text)
    finally:
        tool.close()
    if args.json:
        print(json.dumps(result.__dict__, ensure_ascii=False, indent=2))
    else:
        print(result.text)
    return 0 if result.ok else 1


def _cache(args):
    from appo.tools.search_cache import SearchCache

    return SearchCache(args.cache_file)


def cmd_cache_import(args) -> int:
    cache = _cache(args)
    params = {"max_results": args.max_results, "result_length": args.result_length}
    read, stored = cache.import_json(args.file, backend=args.backend, params=params,
                                     overwrite=args.overwrite)
    print(f"imported {stored} new entries ({read} read) into {cache.path} "
          f"[backend={args.backend}]")
    return 0


def cmd_cache_export(args) -> int:
    cache = _cache(args)
    n = cache.export_json(args.file, backend=args.backend)
    print(f"exported {n} entries to {args.file}")
    return 0


def cmd_cache_stats(args) -> int:
    s = _cache(args).stats()
    print(f"{s.entries} entries in {s.path} ({s.size_bytes / 1e6:.1f} MB)")
    for backend, n in s.by_backend.items():
        print(f"  {backend}: {n}")
    return 0


def cmd_tool_python(args) -> int:
    from appo.tools.python_tool import PythonTool
    from appo.tools.sandbox import describe_capabilities

    code = sys.stdin.read() if args.code == "-" else args.code
    tool = PythonTool(timeout=args.timeout, memory_mb=args.memory_mb, isolation=args.isolation)
    try:
        result = tool.execute(code)
        if args.verbose:
            print(f"[ok={result.ok} error_kind={result.error_kind} "
                  f"latency={result.latency_s * 1000:.1f} ms; "
                  f"{describe_capabilities(tool.capabilities)}]", file=sys.stderr)
    finally:
        tool.close()
    print(result.text)
    return 0 if result.ok else 1
