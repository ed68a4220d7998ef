"""Name -> class registries, so yaml picks components by name (``model.core_method: ...``).

A registry refuses a second entry under the same name (two modules silently shadowing each other
is a bug that surfaces only as wrong results), and an unknown name raises an error that lists
every registered name.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable

from opencood.errors import OpencoodError


class RegistryError(OpencoodError, KeyError):
    """Unknown or duplicate registry name. ``str()`` is the plain message (KeyError quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry:
    """A named mapping from strings to classes or functions.

    >>> MODELS = Registry("model")
    >>> @MODELS.register()
    ... class Foo: ...
    >>> MODELS.get("Foo") is Foo
    True
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Callable] = {}

    def register(self, name: str | None = None) -> Callable:
        """Decorator; registers under ``name`` or the object's ``__name__``."""

        def decorator(obj: Callable) -> Callable:
            self.add(name or obj.__name__, obj)
            return obj

        return decorator

    def add(self, name: str, obj: Callable) -> None:
        if name in self._entries:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered (by {self._entries[name]!r}); "
                f"pick another name")
        self._entries[name] = obj

    def get(self, name: str) -> Callable:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            kinds = self.kind + ("es" if self.kind.endswith("s") else "s")   # losses, models
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered {kinds}: {known}") from None

    def build(self, name: str, *args, **kwargs):
        """``get(name)(*args, **kwargs)``."""
        return self.get(name)(*args, **kwargs)

    def names(self) -> Iterable[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


DATASETS = Registry("dataset")
STRATEGIES = Registry("fusion method")
MODELS = Registry("model")
BACKBONES = Registry("backbone")
FUSIONS = Registry("fusion")
HEADS = Registry("head")
LOSSES = Registry("loss")
POSTPROCESSORS = Registry("postprocessor")
