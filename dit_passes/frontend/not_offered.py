"""cache-dit names that dit_passes does not offer, each refused where it is used, with the reason and what to use.

``import dit_passes as cache_dit`` keeps a script importing; the first call, construction or attribute access of
one of these raises ``NotImplementedError`` naming it, instead of an ``AttributeError`` at import (which says
nothing of what to do) or a stand-in that does something else.
"""
from __future__ import annotations

from typing import Any, Dict

_BLOCKS = ("dit_passes finds the repeated blocks, and how each block reads and returns its streams, from the "
           "traced graph: call enable_cache(pipe) as it is, or name the block lists with "
           "compile_dit(transformer, block_lists=[...])")

REASONS: Dict[str, str] = {
    "BlockAdapter": _BLOCKS,
    "BlockAdapterRegister": _BLOCKS,
    "get_adapter": _BLOCKS,
    "ForwardPattern": _BLOCKS,
    **{f"Pattern_{i}": _BLOCKS for i in range(6)},
    "PatchFunctor": _BLOCKS + " (a model that needs a patched forward is traced as it is)",
    "ParamsModifier": ("per-transformer cache settings: call enable_cache on each transformer with its own config "
                       "(pipe.transformer_2 = enable_cache(pipe.transformer_2, cache_config=...))"),
    "ENV": "cache-dit's environment switches: settings are arguments here (each pass's describe() lists them)",
}


class NotOffered:
    """A cache-dit name refused at its first use (call, construction, attribute)."""

    def __init__(self, name: str, reason: str):
        self.__dict__["_name"], self.__dict__["_reason"] = name, reason

    def error(self) -> NotImplementedError:
        return NotImplementedError(f"cache_dit.{self._name} is not offered by dit_passes: {self._reason}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self.error()

    def __setattr__(self, attr: str, value: Any) -> None:
        raise self.error()

    def __repr__(self) -> str:
        return f"<cache_dit.{self._name}: not offered by dit_passes>"


NOT_OFFERED = {name: NotOffered(name, reason) for name, reason in REASONS.items()}
