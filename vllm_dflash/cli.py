"""`vllm-dflash` command line: one subcommand per job, each in its own module.

Subcommand modules are imported only when chosen, so `vllm-dflash --help`
stays fast and never imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module defines add_arguments(parser) and run(args).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "zoo": ("vllm_dflash.zoo.cli", "build the bundled toy target model (corpus, tokenizer, training)"),
    "train": ("vllm_dflash.training.cli", "train a DFlash drafter for a Hugging Face target"),
    "bench": ("vllm_dflash.bench.cli", "offline throughput / acceptance benchmark"),
    "demo": ("vllm_dflash.bench.demo", "run the bundled pair with and without DFlash"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="vllm-dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        parser.error(f"unknown command {name!r}; choose one of {', '.join(SUBCOMMANDS)}")
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"vllm-dflash {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # bad input: the message names the field and the fix
        print(f"vllm-dflash {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
