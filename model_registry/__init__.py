"""The model registry: experiments registered by a key that says where their code lives.

An experiment class registers itself with the `register` decorator; its key comes from where it lives, so a user
can find the code from the key:
- a built-in experiment in `params/<area>/<module>.py` (installed as the package `gpipe_tf.params`) has the key
  `<area>.<module>.<Class>`, e.g. `toy.classifier.BlobsMlp`;
- an experiment in the user's own importable package has its full module path plus its class name, e.g.
  `mypkg.experiments.MyMlp`: no checkout needs editing to run it.

Look-ups import modules lazily: `get("toy.classifier.BlobsMlp")` imports only that module, `get("mypkg.
experiments.MyMlp")` imports `mypkg.experiments`, and `list_models()` imports every built-in experiment module
plus the modules passed to `import_modules` (the trainer's `--module`). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import traceback
import types
import weakref
from collections.abc import Callable
from typing import TypeVar

# The built-in experiments' package: the checkout's `params/` folder, installed under this name (see setup.py).
PARAMS_PACKAGE = "gpipe_tf.params"

T = TypeVar("T", bound=type)

_REGISTRY: dict[str, type] = {}
# Where each key was registered: (the module body's code object, weakly, and the line), to tell a module that
# defines two classes of one name (the same body) from a module imported again (a new body).
_DEFINED_AT: dict[str, tuple[weakref.ref, int]] = {}


class RegistryError(KeyError):
    """Unknown or duplicate model key."""

    def __str__(self) -> str:
        # KeyError quotes its message; users should read plain text.
        return str(self.args[0]) if self.args else ""


class ModuleImportError(RegistryError):
    """An experiment module raised while it was imported; the error it raised is this one's __cause__."""


_USER_MODULES: list[str] = []


def key_for(cls: type) -> str:
    """The registry key of `cls`: `<area>.<module>.<Class>` below `params/`, else `<module path>.<Class>`."""
    module = cls.__module__
    prefix = PARAMS_PACKAGE + "."
    if module.startswith(prefix):
        if module.count(".") != prefix.count(".") + 1:
            raise RegistryError(
                f"cannot derive a key for {module}.{cls.__qualname__}: built-in experiments live in "
                f"params/<area>/<module>.py, or pass an explicit key: register(key='area.module.Class')")
        return f"{module[len(prefix):]}.{cls.__qualname__}"
    if module in ("__main__", "builtins") or "<" in cls.__qualname__:
        raise RegistryError(
            f"cannot derive a key for {module}.{cls.__qualname__}: define the experiment at the top level of an "
            f"importable module (its key is then '<module path>.<Class>'), or pass an explicit key: "
            f"register(key='area.module.Class')")
    return f"{module}.{cls.__qualname__}"


def register(cls: T | None = None, *, key: str | None = None) -> T | Callable[[T], T]:
    """Class decorator: registers an experiment under `<area>.<module>.<Class>` (or an explicit `key`).

    Registering a second, different class under a taken key is an error, also when one module defines two classes
    of one name; a module imported again (under the same name) registers its classes anew.
    """

    def _register(c: T) -> T:
        k = key or key_for(c)
        old = _REGISTRY.get(k)
        body = _module_body(c.__module__)
        if old is not None and old is not c:
            if (old.__module__, old.__qualname__) != (c.__module__, c.__qualname__):
                raise RegistryError(f"duplicate model key {k!r}: already registered by {old.__module__}."
                                    f"{old.__qualname__}; rename one of the classes")
            first = _DEFINED_AT.get(k)
            if body is not None and first is not None and first[0]() is body[0]:
                raise RegistryError(f"module {c.__module__} defines two experiment classes named {c.__qualname__} "
                                    f"(lines {first[1]} and {body[1]}), both registered as {k!r}, so the second "
                                    "would replace the first; rename one of them")
        _REGISTRY[k] = c
        if body is not None:
            _DEFINED_AT[k] = (weakref.ref(body[0]), body[1])
        c.registry_key = k  # type: ignore[attr-defined]
        return c

    return _register(cls) if cls is not None else _register


def _module_body(module: str) -> tuple[types.CodeType, int] | None:
    """(code object, current line) of the body of `module` when it is running now, found up the call stack (it
    holds the class statement being registered, or the call of a function that registers one), else None (a class
    registered after its module was imported)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == module:
            return frame.f_code, frame.f_lineno
        frame = frame.f_back
    return None


def _names_module(error: ModuleNotFoundError, name: str) -> bool:
    """Whether `error` says that `name` itself (or a package above it) is missing, not a module it imports."""
    return error.name is not None and (name == error.name or name.startswith(error.name + "."))


def _module_files(name: str) -> list[str]:
    """The file or folder of the top-level package of module `name` (found without importing it), or []."""
    spec = importlib.util.find_spec(name.partition(".")[0])
    if spec is None:
        return []
    return [os.path.abspath(p) for p in (spec.submodule_search_locations or [spec.origin]) if p]


def _where_raised(name: str, error: BaseException) -> str | None:
    """`file:line` of the line of module `name`'s own package that raised `error` while `name` was imported: the
    innermost such frame (a call into a library ends at the package's line that made it), the line of a syntax
    error, or else the innermost frame outside Python's import machinery; None if there is none."""
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        return f"{error.filename}:{error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen ")]
    roots = _module_files(name)
    own = [f for f in frames if any(os.path.abspath(f.filename) == root or
                                    os.path.abspath(f.filename).startswith(root + os.sep) for root in roots)]
    frame = (own or frames or [None])[-1]
    return None if frame is None else f"{frame.filename}:{frame.lineno}"


def _import(name: str) -> types.ModuleType:
    """importlib.import_module(name); an error the module raises is a ModuleImportError naming the module, the
    error and the line that raised it. A missing `name` (or a package above it) raises ModuleNotFoundError as it is,
    and a RegistryError (e.g. a duplicate key) stays itself: both already name what is wrong."""
    try:
        return importlib.import_module(name)
    except RegistryError:
        raise
    except Exception as e:  # noqa: BLE001 -- re-raised as one line naming the module (the original is the cause)
        if isinstance(e, ModuleNotFoundError) and _names_module(e, name):
            raise
        where = _where_raised(name, e)
        message = " ".join(str(e).split())
        raise ModuleImportError(
            f"experiment module {name!r} failed to import: {type(e).__name__}{': ' + message if message else ''}"
            f"{f' (at {where})' if where else ''}; fix the module there, or run the trainer with --traceback to see "
            "Python's traceback") from e


def import_modules(names: list[str]) -> None:
    """Imports the user's experiment modules (and, for a package, every module below it) so that they register.

    A name that does not import raises RegistryError naming it; an error raised inside a module is a
    ModuleImportError naming the module, the error and its line. Listed modules are remembered: `list_models`
    imports them again after the registry was cleared.
    """
    for name in names:
        try:
            module = _import(name)
        except ModuleNotFoundError as e:
            raise RegistryError(f"cannot import experiment module {name!r}: no module named {e.name!r}; install the "
                                f"package that holds it (pip install -e PATH) or fix the name") from None
        if hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, prefix=name + "."):
                _import(info.name)
        if name not in _USER_MODULES:
            _USER_MODULES.append(name)


def _import_all() -> None:
    package = importlib.import_module(PARAMS_PACKAGE)
    for info in pkgutil.walk_packages(package.__path__, prefix=PARAMS_PACKAGE + "."):
        _import(info.name)
    import_modules(list(_USER_MODULES))


def list_models() -> list[str]:
    """All registered keys, sorted; imports every built-in experiment module and the user modules given before."""
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

    A three-part key is first looked up among the built-in experiments (`params/<area>/<module>.py`); any key is
    also tried as `<importable module>.<Class>`, the key of an experiment in the user's own package.

    An unknown key raises RegistryError naming the closest registered keys.
    """
    if key not in _REGISTRY:
        module = key.rpartition(".")[0]
        candidates = ([f"{PARAMS_PACKAGE}.{module}"] if key.count(".") == 2 else []) + ([module] if module else [])
        for name in candidates:
            try:
                _import(name)
            except ModuleNotFoundError:
                pass  # the experiment module is missing: an unknown key (an error inside it is a ModuleImportError)
            if key in _REGISTRY:
                break
    if key not in _REGISTRY:
        keys = list_models()
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise RegistryError(f"unknown model {key!r}; {hint}run `python trainer.py --list_models` to see all "
                            f"{len(keys)} models")
    return _REGISTRY[key]
