"""The ``dit-passes`` console script.

    dit-passes inspect flux                          # discovered structure + what each pass did
    dit-passes inspect wan --passes "dbcache(Fn_compute_blocks=1)" --graph
    dit-passes inspect flux --passes "ulysses(size=2)" --rank 1 --graph   # rank 1's graph, from this one process
    dit-passes demo ... | fidelity ... | bench ... | coverage ... | fuzz ... | soak ...   # dit_passes.<command>:main

``inspect`` builds a tiny zoo model (random weights, CPU), captures it with ``compile_dit`` and prints
``structure.summary()``, the per-pass explain (counts and diff), the resident memory by kind and block
(``memory_report()``), and with ``--graph`` the graph after the passes. ``--passes`` is a pipeline text
(:mod:`dit_passes.pass_spec`: names with literal arguments). With a parallel pass the passes lower as one rank
(``--rank``, default 0) of a world of the passes' size under a fake process group
(:mod:`dit_passes.parallel.fake_world`): the graph printed is the one that rank gets from a real launch, its
collectives included, and nothing is launched. A user's mistake (unknown model or pass, an argument the pass does
not take, a pass refusing the model) is one line on stderr and exit status 2; ``--debug`` shows the traceback.
A residual cache whose default cut (``Fn_compute_blocks`` / ``Bn_compute_blocks``) leaves no block of the tiny
model to cache gets the largest cut that does, with a note; a cut the user gave is never changed.
``demo`` / ``fidelity`` / ``bench`` import their module only when used, so a missing one gives a clear message
instead of breaking the other commands.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from typing import Dict, List, Optional, Sequence, Tuple

# subcommand -> "module" whose ``main(argv)`` implements it (or "module:function")
DELEGATED = {
    "demo": ("dit_passes.demo", "run the end-to-end demo"),
    "fidelity": ("dit_passes.demo:fidelity_main", "compare a compiled pipeline's images with the original's"),
    "bench": ("dit_passes.bench", "time a compiled transformer against the original"),
    "coverage": ("dit_passes.coverage", "every DiT class of diffusers x every pass: exact / refused / error"),
    "fuzz": ("dit_passes.coverage_fuzz", "every pass on configs drawn around each class's tiny one"),
    "soak": ("dit_passes.soak", "one served pipeline under mixed requests, each checked against it run alone"),
}

# ``dit-passes inspect --help`` shows these; tests/test_cli.py runs each of them
INSPECT_EXAMPLES = (
    ("dit-passes inspect flux", "structure, passes' explain, memory"),
    ("dit-passes inspect wan --passes dbcache --graph", "a cache on a 2-block model: its cut adapted, noted"),
    ("dit-passes inspect wan --passes \"cleanup,dbcache(Fn_compute_blocks=1,residual_diff_threshold=0.12)\"",
     "passes with arguments"),
    ("dit-passes inspect flux --passes \"ulysses(size=2)\" --rank 1 --graph", "rank 1 of 2, without launching ranks"),
    ("dit-passes inspect flux --passes \"ring(size=2),tensor_parallel(size=2),dbcache(Fn_compute_blocks=1)\"",
     "a (cp, tp) mesh of 4 ranks, rank 0"),
)

# the cut of a block-range cache: compute the first Fn and last Bn blocks, cache the ones between
_CUT_FIELDS = ("Fn_compute_blocks", "Bn_compute_blocks")


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit status 2."""


def available_passes() -> Dict[str, type]:
    """Pass name (``Pass.name``) -> class, for every pass exported by :mod:`dit_passes.passes`; a name two classes
    share goes to the one exported first (the other is reached by its class name, :mod:`dit_passes.pass_spec`)."""
    from .pass_spec import pass_registry

    out: Dict[str, type] = {}
    for cls in pass_registry().values():
        out.setdefault(cls.name, cls)
    return out


def _fit_cut(spec, built, model: str, n_blocks: int) -> Tuple[object, Optional[str]]:
    """``spec`` with a cut that leaves a block of ``n_blocks`` to cache, and the note saying so (None if unchanged).
    The cut that fits keeps Bn if it leaves a block to compute first, else lowers it, and takes the largest Fn up to
    the current one that leaves a block to cache. Only defaults change: where that cut changes a value the user
    gave, it is refused, the cut that fits named in the message."""
    config = getattr(built, "config", None)
    if not all(isinstance(getattr(config, f, None), int) for f in _CUT_FIELDS):
        return spec, None
    fn, bn = config.Fn_compute_blocks, config.Bn_compute_blocks
    if fn + bn < n_blocks:
        return spec, None
    if n_blocks < 2:
        raise UsageError(f"{spec}: {model} has {n_blocks} block; a block-range cache needs 2 or more (one computed, "
                         f"one cached): pick another model")
    fit_bn = min(bn, n_blocks - 2)
    fitted = {"Fn_compute_blocks": max(1, min(fn, n_blocks - 1 - fit_bn)), "Bn_compute_blocks": fit_bn}
    changed = {k: v for k, v in fitted.items() if getattr(config, k) != v}
    new = spec.with_kwargs(**changed)
    if set(spec.kwargs) & set(changed):  # the cut that fits changes a value the user gave
        raise UsageError(f"{spec}: Fn_compute_blocks + Bn_compute_blocks = {fn} + {bn} leaves no block to cache: "
                         f"{model} has {n_blocks}; use e.g. --passes \"{new}\"")
    defaults = ", ".join(f"{k}={getattr(config, k)}" for k in changed)
    return new, (f"{spec.name}: the default {defaults} leaves no block of {model}'s {n_blocks} to cache; "
                 f"using {new} (give {' / '.join(changed)} to choose)")


def _ranks_of(built) -> Tuple[int, int]:
    """(context-parallel ranks, tensor-parallel ranks) a built pass asks for; (1, 1) for any other pass."""
    from .passes import USP, Ring, TensorParallel, Ulysses

    if isinstance(built, (Ulysses, Ring, USP)):
        return built.ulysses_size * built.ring_size, 1
    if isinstance(built, TensorParallel):
        return 1, built.size
    return 1, 1


def _build_passes(specs, ranks: List[Tuple[int, int]], cp: int, tp: int):
    """The passes; context and tensor parallelism together each get their group of a (cp, tp) mesh (tp
    innermost), as :func:`dit_passes.passes.parallel_plan.parallel_passes` builds them for a real launch."""
    from .parallel.mesh import ParallelMesh

    if not (cp > 1 and tp > 1):
        return [spec.build() for spec in specs]
    mesh = ParallelMesh((("cp", cp), ("tp", tp)))
    return [spec.build(group=mesh.group("cp")) if c > 1 else spec.build(group=mesh.group("tp")) if t > 1
            else spec.build() for spec, (c, t) in zip(specs, ranks)]


def _inspect(args: argparse.Namespace) -> int:
    import torch

    from . import compile_dit
    from .models.zoo import FAMILIES, MORE_FAMILIES_HERE, build
    from .parallel.fake_world import fake_world
    from .pass_spec import parse_pass_specs
    from .passes import Cleanup

    if args.model not in FAMILIES + MORE_FAMILIES_HERE:
        raise UsageError(f"unknown model {args.model!r}; zoo families: {', '.join(FAMILIES + MORE_FAMILIES_HERE)}")
    specs = parse_pass_specs(args.passes)
    for s in specs:
        if s.cls is Cleanup:
            s.build()  # an argument Cleanup does not take is refused, not dropped
            if args.no_cleanup:
                raise UsageError("--no-cleanup with cleanup in --passes: drop one of them")
    # compile_dit runs Cleanup first unless told not to, as it does for every user: named or not, it runs once
    cleanup = bool(specs) and not args.no_cleanup
    specs = [s for s in specs if s.cls is not Cleanup]
    zm = build(args.model, seed=args.seed)
    if args.variant not in zm.variants:
        raise UsageError(f"{args.model} has no variant {args.variant!r}; variants: {', '.join(zm.variants)}")
    n_blocks = sum(zm.expected["block_lists"].values())
    notes = []
    fitted = []
    for spec in specs:
        spec, note = _fit_cut(spec, spec.build(), args.model, n_blocks)
        fitted.append(spec)
        notes += [note] if note else []
    ranks = [_ranks_of(spec.build()) for spec in fitted]
    cp = max([c for c, _ in ranks], default=1)
    tp = max([t for _, t in ranks], default=1)
    world = cp * tp
    if args.rank is not None and world == 1:
        raise UsageError(f"--rank {args.rank}: no parallel pass in --passes {args.passes!r}, so there is one rank; "
                         f"add one (e.g. \"ulysses(size=2)\") or drop --rank")
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise UsageError(f"--rank {rank}: the passes make a world of {world} ranks; pick one of 0..{world - 1}")
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    inputs = zm.make_inputs(batch=args.batch, variant=args.variant)
    where = "" if world == 1 else (f"; rank {rank} of {world}, lowered under a fake process group (collectives "
                                   f"are graph nodes here, none ran)")
    with fake_world(rank, world) if world > 1 else contextlib.nullcontext():
        passes = _build_passes(fitted, ranks, cp, tp)
        compiled = compile_dit(zm.model, passes=passes, cleanup=cleanup, example_inputs=inputs)
        lowered = compiled._current()
        print(f"# {args.model} ({type(zm.model).__name__}), variant={args.variant}, batch={args.batch}{where}; "
              f"captured in {lowered.captured.seconds:.2f} s")
        for note in notes:
            print(f"note: {note}")
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


def cmd_inspect(args: argparse.Namespace) -> int:
    """:func:`_inspect`, a user's mistake as one line (exit status 2); a pass that crashed (a defect, not a
    refusal) keeps its traceback."""
    from .infra.pass_base import PassCrashed, Refusal
    from .pass_spec import PassSpecError

    try:
        return _inspect(args)
    except (UsageError, PassSpecError, Refusal) as e:
        if args.debug or isinstance(e, PassCrashed):
            raise
        print(f"dit-passes: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


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
    examples = "\n".join(f"  {cmd}\n      {what}" for cmd, what in INSPECT_EXAMPLES)
    p = sub.add_parser("inspect", help="capture a zoo model and show its structure and the passes' effect",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=f"examples:\n{examples}")
    p.add_argument("model", help="zoo family name, e.g. flux, wan, hunyuanvideo")
    p.add_argument("--passes", default="cleanup",
                   help="comma-separated passes, each a name or name(key=value, ...) with literal values, e.g. "
                        "\"ulysses(size=2),dbcache(Fn_compute_blocks=1)\"; names as in dit_passes.passes, "
                        "case-insensitive. Cleanup runs first whenever a pass is given, as compile_dit runs it "
                        "(default: cleanup; \"\": no pass, not even cleanup)")
    p.add_argument("--rank", type=int, default=None,
                   help="with a parallel pass: the rank whose graph to lower and print, from this one process under "
                        "a fake process group of the passes' size (default 0)")
    p.add_argument("--variant", default="default", help="input variant of the zoo model (default: default)")
    p.add_argument("--batch", type=int, default=1, help="batch size of the example call (2: a CFG pair)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the zoo model")
    p.add_argument("--graph", action="store_true", help="also print the graph after the passes")
    p.add_argument("--no-cleanup", action="store_true",
                   help="lower without the Cleanup pass compile_dit runs first (compile_dit(cleanup=False))")
    p.add_argument("--debug", action="store_true", help="show the traceback of a refused pass or bad argument")
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
