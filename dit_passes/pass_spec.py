"""Pass pipelines written as text, for the command line: ``"ulysses(size=2),dbcache(Fn_compute_blocks=1)"``.

Each item is a pass name, optionally called with literal arguments: ``name``, ``name(2)``, ``name(key=value, ...)``.
The text is parsed as a Python list expression (``ast.parse``) and every argument is read with
``ast.literal_eval``: numbers, strings, booleans, ``None``, tuples, lists and dicts only; a name, attribute,
operator or call in an argument is refused, nothing is evaluated.

Names are those of :mod:`dit_passes.passes`, case-insensitive and with or without underscores: a pass's ``name``
(``tensor_parallel``, ``pab``) or its class name (``TensorParallel``, ``PyramidAttentionBroadcast``). A name two
classes share as ``Pass.name`` is taken by the class whose own name it is; the other is reached by its class name.

    specs = parse_pass_specs("ulysses(size=2), dbcache(Fn_compute_blocks=1)")
    passes = [s.build() for s in specs]         # Ulysses(size=2), DBCache(Fn_compute_blocks=1)
    str(specs[0])                                # 'ulysses(size=2)'

Every mistake (syntax, unknown name, an argument that is not a literal, one the class does not take or refuses)
is a :class:`PassSpecError` whose one-line message names the item and what to write instead.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any, Dict, List, Tuple

from .infra.pass_base import Pass

__all__ = ["PassSpec", "PassSpecError", "pass_arguments", "pass_registry", "parse_pass_specs"]

# Arguments a command line cannot give: a process group is made by whoever runs the ranks, an object by code.
_NOT_FROM_TEXT = ("self", "group", "config", "calibrator", "filter_fn", "reference", "tensors")


class PassSpecError(ValueError):
    """A pass pipeline's text is wrong; the message is one line naming the item and the fix."""


def _key(name: str) -> str:
    return name.replace("_", "").lower()


def pass_registry() -> Dict[str, type]:
    """Display name -> class for every pass :mod:`dit_passes.passes` exports: ``Pass.name`` where one class has
    it, the class name otherwise."""
    from . import passes as passes_mod

    classes = [getattr(passes_mod, a) for a in passes_mod.__all__]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, Pass) and c is not Pass]
    owners: Dict[str, List[type]] = {}
    for c in classes:
        owners.setdefault(c.name, []).append(c)
    return {(c.name if len(owners[c.name]) == 1 else c.__name__): c for c in classes}


def _lookup() -> Dict[str, type]:
    """Normalised name (lower case, no underscores) -> class; a class name wins over another class's pass name."""
    table: Dict[str, type] = {}
    for display, c in pass_registry().items():
        table.setdefault(_key(display), c)
    for c in pass_registry().values():
        table[_key(c.__name__)] = c
    return table


def pass_arguments(cls: type) -> str:
    """The arguments of ``cls`` a pipeline text can give, as ``name=default`` (required ones bare): its
    constructor's, or the fields of its config dataclass for a pass built from ``config=`` or keyword fields."""
    params = inspect.signature(cls.__init__).parameters.values()
    shown = []
    for p in params:
        if p.name in _NOT_FROM_TEXT or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        shown.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    if "config" in inspect.signature(cls.__init__).parameters:
        try:
            config = cls().config
        except Exception:  # noqa: BLE001 - a pass whose defaults cannot build shows its constructor only
            config = None
        if dataclasses.is_dataclass(config):
            shown += [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                      if f.name != "cache_type"]
        else:  # its config has no defaults that build: name where its fields are told
            shown.append(f"the fields of its config: help(dit_passes.passes.{cls.__name__})")
    return ", ".join(shown)


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One item of a pipeline: the class it names and the literal arguments it was given."""

    cls: type
    args: Tuple[Any, ...] = ()
    kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The class's name in :func:`pass_registry` (its ``Pass.name`` unless another class shares it)."""
        return next(k for k, c in pass_registry().items() if c is self.cls)

    def with_kwargs(self, **kwargs: Any) -> "PassSpec":
        return dataclasses.replace(self, kwargs={**self.kwargs, **kwargs})

    def build(self, **extra: Any) -> Pass:
        """The pass; ``extra`` are keywords the text cannot hold (``group=``). A constructor's refusal of the
        arguments becomes a :class:`PassSpecError` naming the arguments the pass takes."""
        try:
            return self.cls(*self.args, **self.kwargs, **extra)
        except (TypeError, ValueError) as e:
            raise PassSpecError(f"{self}: {_one_line(e)}; {self.name} takes ({pass_arguments(self.cls)})") from e

    def __str__(self) -> str:
        inner = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(inner)})" if inner else self.name


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _literal(node: ast.AST, item: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise PassSpecError(f"{item}: {ast.unparse(node)!r} is not a literal; arguments are numbers, strings "
                            f"(quoted), True / False / None, tuples, lists or dicts") from None


def parse_pass_specs(text: str) -> List[PassSpec]:
    """The pipeline ``text`` (see the module docstring) as specs in order; ``""`` is no pass."""
    if not text.strip():
        return []
    try:
        tree = ast.parse(f"[{text}]", mode="eval")
    except SyntaxError as e:
        raise PassSpecError(f"cannot read the pass list {text!r} ({e.msg}); write it as "
                            f"name,name(key=value,...), e.g. \"ulysses(size=2),dbcache(Fn_compute_blocks=1)\"") from None
    if not isinstance(tree.body, ast.List):  # e.g. "a] + [b": not a plain comma-separated list
        raise PassSpecError(f"cannot read the pass list {text!r}; write it as name,name(key=value,...)")
    table = _lookup()
    specs = []
    for node in tree.body.elts:
        item = ast.unparse(node)
        call = node if isinstance(node, ast.Call) else None
        head = call.func if call is not None else node
        if not isinstance(head, ast.Name):
            raise PassSpecError(f"{item!r} is not a pass; items are name or name(key=value, ...)")
        cls = table.get(_key(head.id))
        if cls is None:
            raise PassSpecError(f"unknown pass {head.id!r}; known passes: {', '.join(sorted(pass_registry()))}")
        args: Tuple[Any, ...] = ()
        kwargs: Dict[str, Any] = {}
        if call is not None:
            if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
                raise PassSpecError(f"{item}: * and ** are not arguments; write key=value")
            args = tuple(_literal(a, item) for a in call.args)
            kwargs = {k.arg: _literal(k.value, item) for k in call.keywords}
            bad = [k for k in kwargs if k in _NOT_FROM_TEXT]
            if bad:
                raise PassSpecError(f"{item}: {bad[0]} cannot be given as text (it is an object the caller builds); "
                                    f"{cls.name} takes ({pass_arguments(cls)})")
        specs.append(PassSpec(cls, args, kwargs))
    return specs
