"""The ``dit-passes`` console script.

    dit-passes inspect flux                          # discovered structure + what each pass did
    dit-passes inspect wan --passes cleanup --variant alt_resolution --graph
    dit-passes demo ... | fidelity ... | bench ... | coverage ... | fuzz ...   # delegated to dit_passes.<command>:main

``inspect`` builds a tiny zoo model (random weights, CPU), captures it with ``compile_dit`` and prints
``structure.summary()``, the per-pass explain (counts and diff), the resident memory by kind and block
(``memory_report()``), and with ``--graph`` the graph after
the passes. ``demo`` / ``fidelity`` / ``bench`` import their module only when used, so a missing one
gives a clear message instead of breaking the other commands.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Sequence

# subcommand -> "module" whose ``main(argv)`` implements it (or "module:function")
DELEGATED = {
    "demo": ("dit_passes.demo", "run the end-to-end demo"),
    "fidelity": ("dit_passes.demo:fidelity_main", "compare a compiled pipeline's images with the original's"),
    "bench": ("dit_passes.bench", "time a compiled transformer against the original"),
    "coverage": ("dit_passes.coverage", "every DiT class of diffusers x every pass: exact / refused / error"),
    "fuzz": ("dit_passes.coverage_fuzz", "every pass on configs drawn around each class's tiny one"),
}


def available_passes() -> Dict[str, type]:
    """Pass name (``Pass.name``) -> class, for every pass exported by :mod:`dit_passes.passes`."""
    from . import passes as passes_mod
    from .infra.pass_base import Pass

    out: Dict[str, type] = {}
    for attr in getattr(passes_mod, "__all__", dir(passes_mod)):
        obj = getattr(passes_mod, attr, None)
        if isinstance(obj, type) and issubclass(obj, Pass) and obj is not Pass:
            out[obj.name] = obj
    return out


def _parse_passes(spec: str) -> List[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = available_passes()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"dit-passes: unknown pass(es) {unknown}; available: {', '.join(sorted(known))}")
    return names


def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from . import compile_dit
    from .models.zoo import FAMILIES, MORE_FAMILIES_HERE, build

    if args.model not in FAMILIES + MORE_FAMILIES_HERE:
        print(f"dit-passes: unknown model {args.model!r}; zoo families: {', '.join(FAMILIES + MORE_FAMILIES_HERE)}",
              file=sys.stderr)
        return 2
    names = _parse_passes(args.passes)
    known = available_passes()
    # compile_dit always runs Cleanup first unless told not to: name it once, in its place
    passes = [known[n]() for n in names if n != "cleanup"]
    zm = build(args.model, seed=args.seed)
    if args.variant not in zm.variants:
        print(f"dit-passes: {args.model} has no variant {args.variant!r}; variants: {', '.join(zm.variants)}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    inputs = zm.make_inputs(batch=args.batch, variant=args.variant)
    compiled = compile_dit(zm.model, passes=passes, cleanup="cleanup" in names, example_inputs=inputs)
    lowered = compiled._current()
    print(f"# {args.model} ({type(zm.model).__name__}), variant={args.variant}, batch={args.batch}; "
          f"captured in {lowered.captured.seconds:.2f} s")
    print("## structure")
    print(compiled.structure.summary())
    print("## passes")
    print(lowered.manager.explain())
    print("## memory")
    print(compiled.memory_report())
    if args.graph:
        print("## graph")
        print(compiled.code)
    return 0


def cmd_delegated(command: str, argv: Sequence[str]) -> int:
    target, _ = DELEGATED[command]
    module_name, _, function = target.partition(":")
    function = function or "main"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but one of its imports is missing: show the real error
        print(f"dit-passes {command}: not available in this installation ({module_name} does not exist yet)",
              file=sys.stderr)
        return 2
    main_fn = getattr(module, function, None)
    if main_fn is None:
        print(f"dit-passes {command}: {module_name} has no {function}(argv) function", file=sys.stderr)
        return 2
    return int(main_fn(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dit-passes", description="Graph passes for diffusers DiTs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="capture a zoo model and show its structure and the passes' effect")
    p.add_argument("model", help="zoo family name, e.g. flux, wan, hunyuanvideo")
    p.add_argument("--passes", default="cleanup", help="comma-separated pass names (default: cleanup)")
    p.add_argument("--variant", default="default", help="input variant of the zoo model (default: default)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the example call (2: a CFG pair)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the zoo model")
    p.add_argument("--graph", action="store_true", help="also print the graph after the passes")
    for name, (_, help_text) in DELEGATED.items():
        d = sub.add_parser(name, help=help_text, add_help=False)
        d.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:  # hand every further argument (including --help) to the module
        return cmd_delegated(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return cmd_inspect(args)


if __name__ == "__main__":
    sys.exit(main())
