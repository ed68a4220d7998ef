"""Name -> class registries, so yaml picks components by name (``model.core_method: ...``).

A component registers itself and the schema of its arguments with one decorator, next to its
class (the schema is a frozen dataclass in the style of :mod:`opencood.config_schema`)::

    @FUSIONS.register("v2vnet", args=V2VNetArgs)
    class V2VNetFusion(FusionModule):
        def __init__(self, args: V2VNetArgs, in_channels: int, num_anchors: int): ...

The config loader asks the registries for those schemas (:data:`BY_KIND`), so a component's
arguments are checked and completed like every other section, and the builder calls the class
with the parsed arguments. A registry given a package imports every module of that package on
its first lookup: a new file in ``opencood/models`` registers itself, no import line elsewhere.

A registry refuses a second entry under the same name (two modules silently shadowing each other
is a bug that surfaces only as wrong results), and an unknown name raises an error that lists
every registered name.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Dict, Iterable, Optional

from opencood import config_schema
from opencood.errors import OpencoodError


class RegistryError(OpencoodError, KeyError):
    """Unknown or duplicate registry name. ``str()`` is the plain message (KeyError quotes it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry:
    """A named mapping from strings to classes or functions, each with an optional schema of its
    arguments.

    >>> MODELS = Registry("model")
    >>> @MODELS.register()
    ... class Foo: ...
    >>> MODELS.get("Foo") is Foo
    True

    Args:
        kind: what an entry is, for messages and for the schema's ``args_of`` ("model").
        package: imported module by module on the first lookup (None: nothing to discover).
    """

    def __init__(self, kind: str, package: str | None = None):
        self.kind = kind
        self.package = package
        self._entries: Dict[str, Callable] = {}
        self._schemas: Dict[str, Optional[type]] = {}
        self._discovered = package is None

    def register(self, name: str | None = None, *, args: type | None = None) -> Callable:
        """Decorator; registers under ``name`` or the object's ``__name__``, with ``args`` the
        dataclass of its config arguments (None: they stay an open mapping)."""

        def decorator(obj: Callable) -> Callable:
            self.add(name or obj.__name__, obj, args)
            return obj

        return decorator

    def add(self, name: str, obj: Callable, args: type | None = None) -> None:
        if name in self._entries:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered (by {self._entries[name]!r}); "
                f"pick another name")
        self._entries[name] = obj
        self._schemas[name] = args

    def discover(self) -> None:
        """Import every module of ``package`` once; each registers what it defines."""
        if self._discovered:
            return
        self._discovered = True        # before importing: a module may look a name up
        try:
            package = importlib.import_module(self.package)
            # A plain module (no __path__) registers its entries when imported.
            for module in pkgutil.iter_modules(getattr(package, "__path__", [])):
                importlib.import_module(f"{self.package}.{module.name}")
        except BaseException:
            self._discovered = False   # the next lookup raises the import error again
            raise

    def get(self, name: str) -> Callable:
        self.discover()
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            kinds = self.kind + ("es" if self.kind.endswith("s") else "s")   # losses, models
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered {kinds}: {known}") from None

    def args_schema(self, name: str) -> Optional[type]:
        """The dataclass ``name`` registered its arguments with; None for a name registered
        without one, or not registered."""
        return self.schemas().get(name)

    def schemas(self) -> Dict[str, Optional[type]]:
        """Every registered name -> its arguments' schema (or None)."""
        self.discover()
        return {name: self._schemas.get(name) for name in self._entries}

    def parse_args(self, name: str, args: Any, key: str) -> Any:
        """``args`` -> the dataclass ``name`` registered, every default filled in: ``args``
        itself when it is one already (a loaded config's ``model.args``, parsed by the loader:
        never parsed twice), else a mapping (a partial one, or a checkpoint's plain config)
        parsed; the mapping itself without a schema. ``key``: the dotted config key of
        ``args``, for the SchemaError message."""
        schema = self.args_schema(name)
        if schema is None or isinstance(args, schema):
            return args
        return config_schema.parse(schema, args, key, registered_schemas())

    def build(self, name: str, args: Any, key: str, **context) -> Any:
        """``get(name)(parse_args(name, args, key), **context)``: the component built from its
        config arguments (e.g. ``in_channels`` in ``context``)."""
        return self.get(name)(self.parse_args(name, args, key), **context)

    def names(self) -> Iterable[str]:
        self.discover()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self.discover()
        return name in self._entries

    def __len__(self) -> int:
        self.discover()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"


DATASETS = Registry("dataset")
STRATEGIES = Registry("fusion method", package="opencood.strategies")
MODELS = Registry("model", package="opencood.models")
FUSIONS = Registry("fusion", package="opencood.models")
# What turns an agent's sensor data into its BEV map (``model.args.encoder``): pillars, lift-splat.
ENCODERS = Registry("encoder", package="opencood.models")
LOSSES = Registry("loss", package="opencood.losses")
POSTPROCESSORS = Registry("postprocessor")
# Data set formats (``fusion.dataset``): opencood.data.formats registers each.
DATA_FORMATS = Registry("data set format", package="opencood.data.formats")
# The registries the config schema looks names up in (``spec(args_of=...)``,
# ``spec(registered=...)``), by kind.
BY_KIND = {registry.kind: registry for registry in (STRATEGIES, MODELS, FUSIONS, ENCODERS,
                                                         LOSSES, DATA_FORMATS)}


def registered_schemas() -> config_schema.Registered:
    """kind -> {registered name: its arguments' schema or None}: what
    :func:`opencood.config_schema.parse` checks names and arguments against."""
    return {kind: registry.schemas() for kind, registry in BY_KIND.items()}
