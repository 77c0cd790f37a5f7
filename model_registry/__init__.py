"""The model registry: experiments registered by key `<area>.<module>.<Class>`.

An experiment class in `params/<area>/<module>.py` registers itself with the `register` decorator; its key comes
from where it lives, so a user can find the code from the key. Look-ups import `params.<area>.<module>` lazily:
`get("toy.classifier.BlobsMlp")` imports only that module, and `list_models()` imports every module under
`params/`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from typing import Callable, TypeVar

PARAMS_PACKAGE = "params"

T = TypeVar("T", bound=type)

_REGISTRY: dict[str, type] = {}


class RegistryError(KeyError):
    """Unknown or duplicate model key."""

    def __str__(self) -> str:
        # KeyError quotes its message; users should read plain text.
        return str(self.args[0]) if self.args else ""


def key_for(cls: type) -> str:
    """The registry key of `cls`: its module path below `params.` plus its class name."""
    module = cls.__module__
    prefix = PARAMS_PACKAGE + "."
    if not module.startswith(prefix) or module.count(".") != 2:
        raise RegistryError(
            f"cannot derive a key for {module}.{cls.__qualname__}: experiments live in "
            f"params/<area>/<module>.py, or pass an explicit key: register(key='area.module.Class')")
    return f"{module[len(prefix):]}.{cls.__qualname__}"


def register(cls: T | None = None, *, key: str | None = None) -> T | Callable[[T], T]:
    """Class decorator: registers an experiment under `<area>.<module>.<Class>` (or an explicit `key`).

    Registering a second, different class under a taken key is an error; re-registering the same class is
    allowed (a module imported twice under one name).
    """

    def _register(c: T) -> T:
        k = key or key_for(c)
        old = _REGISTRY.get(k)
        if old is not None and old is not c and (old.__module__, old.__qualname__) != (c.__module__, c.__qualname__):
            raise RegistryError(f"duplicate model key {k!r}: already registered by {old.__module__}."
                                f"{old.__qualname__}; rename one of the classes")
        _REGISTRY[k] = c
        c.registry_key = k  # type: ignore[attr-defined]
        return c

    return _register(cls) if cls is not None else _register


def _import_all() -> None:
    package = importlib.import_module(PARAMS_PACKAGE)
    for info in pkgutil.walk_packages(package.__path__, prefix=PARAMS_PACKAGE + "."):
        importlib.import_module(info.name)


def list_models() -> list[str]:
    """All registered keys, sorted; imports every experiment module under `params/`."""
    _import_all()
    return sorted(_REGISTRY)


def summary(cls: type) -> str:
    """The first paragraph of the experiment's docstring (inherited if it has none) on one line."""
    doc = inspect.getdoc(cls) or ""
    first = doc.split("\n\n", 1)[0]
    return " ".join(first.split()) or "(no docstring)"


def describe_models() -> list[tuple[str, str]]:
    """(key, one-line summary) of every registered experiment, sorted by key; imports every experiment module."""
    return [(key, summary(_REGISTRY[key])) for key in list_models()]


def get(key: str) -> type:
    """The experiment class registered under `key`, importing its module if needed.

    An unknown key raises RegistryError naming the closest registered keys.
    """
    if key not in _REGISTRY:
        parts = key.split(".")
        if len(parts) == 3:
            try:
                importlib.import_module(f"{PARAMS_PACKAGE}.{parts[0]}.{parts[1]}")
            except ModuleNotFoundError as e:
                # Only a missing experiment module means "unknown key"; a broken import inside it must surface.
                if not (e.name or "").startswith(PARAMS_PACKAGE):
                    raise
    if key not in _REGISTRY:
        keys = list_models()
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise RegistryError(f"unknown model {key!r}; {hint}run `python trainer.py --list_models` to see all "
                            f"{len(keys)} models")
    return _REGISTRY[key]
