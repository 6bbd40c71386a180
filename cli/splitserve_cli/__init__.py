"""The `splitserve` console command: one entry point, lazily imported subcommands.

Each subcommand lives in its own package with a ``main(argv: list[str]) -> int``; this
package only maps names to modules and imports the one that is asked for. It sits above the
operator, runtime and planner packages and imports none of them at module level (the layer
rules in ``.importlinter``), so ``splitserve --help`` and ``splitserve operator`` never import
torch, and an install without the runtime extra (the operator image) still has a working
command that says what is missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EXIT_UNAVAILABLE = 2


@dataclass(frozen=True)
class Subcommand:
    module: str
    help: str
    extra: str  # the pip extra that provides its dependencies


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        "splitserve_runtime.server.app", "run the inference runtime (OpenAI API, prefill/decode/aggregated)", "runtime"
    ),
    "router": Subcommand("splitserve_runtime.router.app", "run the prefill/decode-aware router", "runtime"),
    "operator": Subcommand("splitserve_operator.main", "run the Kubernetes operator", "operator"),
    "make-tiny-model": Subcommand(
        "splitserve_runtime.model.tiny", "write a tiny random checkpoint for tests and demos", "runtime"
    ),
    "plan": Subcommand("splitserve_planner.cli", "size prefill/decode pools for a workload", "operator"),
}


def _version() -> str:
    from splitserve_contract import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated (prefill/decode) LLM serving on Kubernetes.",
        epilog="Run `splitserve <command> --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"splitserve {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    for name, sub in SUBCOMMANDS.items():
        commands.add_parser(name, help=sub.help, add_help=False)
    commands.add_parser("version", help="print the version")
    return parser


def _load(name: str, sub: Subcommand) -> Callable[[list[str]], int] | None:
    try:
        module = importlib.import_module(sub.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if sub.module == missing or sub.module.startswith(missing + "."):
            print(
                f"splitserve: `{name}` is not available in this install (module {sub.module} is missing)",
                file=sys.stderr,
            )
        else:
            print(
                f"splitserve: `{name}` is not available in this install: it needs the "
                f"package {missing!r} (pip install 'splitserve[{sub.extra}]')",
                file=sys.stderr,
            )
        return None
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"splitserve: `{name}` is not available in this install ({sub.module} has no main())", file=sys.stderr)
        return None
    return entry  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        parser = _parser()
        parser.parse_args(args)  # --help / --version exit here
        parser.print_help(sys.stderr)
        return EXIT_UNAVAILABLE
    name, rest = args[0], args[1:]
    if name == "version":
        print(f"splitserve {_version()}")
        return 0
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        _parser().error(f"unknown command {name!r} (choose from {', '.join([*SUBCOMMANDS, 'version'])})")
    entry = _load(name, sub)
    if entry is None:
        return EXIT_UNAVAILABLE
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
