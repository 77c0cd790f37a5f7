"""Hyper-parameter trees: named, documented, freezable and round-trippable as text.

A `Params` holds fields defined up front with a default and a doc string, so a typo fails loudly (with a
"did you mean" hint) instead of silently creating a new setting. A tree is written as readable text, one
`dotted.path : value` line per leaf, that parses back exactly; command-line overrides such as
`train.learning_rate=0.1,task.hidden_dims=[64, 64]` are type-checked against the current values.

Values in text are Python literals read by a small AST walker (never `eval`); classes and functions are written
as import paths and TensorFlow dtypes as `tf.float32`. TensorFlow is imported only when such a dtype is parsed.
"""

from __future__ import annotations

import ast
import copy as _copy
import difflib
import functools
import importlib
import inspect
import keyword
import math
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["ParamsError", "UnknownParamError", "Params", "InstantiableParams", "parse_overrides"]

_SCALARS = (type(None), bool, int, str, bytes)


class ParamsError(ValueError):
    """Bad Params use: unknown name, frozen tree, bad override value or type."""

    # Raised while tf.function traces user code (a batch that M does not divide, found only when the step is
    # traced) in a function AutoGraph converted (a user's tf.autograph.to_graph; the trainer traces without it),
    # AutoGraph would re-raise it as a StagingError with a multi-line message; this attribute (AutoGraph's own
    # opt-out) lets it through as itself, so callers catching ParamsError see it.
    ag_pass_through = True


class UnknownParamError(ParamsError, AttributeError):
    """A name that is not defined; an AttributeError too, so `hasattr` and `getattr(p, n, d)` keep working."""


def _one_edit_apart(a: str, b: str) -> bool:
    # difflib's ratio is too strict for short names ('lr' vs 'lx' scores 0.5), so catch the one-keystroke
    # typos (substitution, insertion, deletion, adjacent swap) explicitly.
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return len(diffs) == 1 or (len(diffs) == 2 and diffs[1] == diffs[0] + 1
                                   and a[diffs[0]] == b[diffs[1]] and a[diffs[1]] == b[diffs[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def _unknown(key: str, known: list[str], prefix: str = "", context: str = "") -> UnknownParamError:
    """Builds the error for an undefined `prefix + key`, suggesting close names among `known`."""
    close = [n for n in known if n.lower() == key.lower() or _one_edit_apart(n, key)]
    close += [n for n in difflib.get_close_matches(key, known, n=3, cutoff=0.6) if n not in close]
    msg = f"unknown param '{prefix}{key}'"
    if prefix:
        msg += f" (no '{key}' in '{prefix[:-1]}')"
    if close:
        msg += "; did you mean " + " or ".join(f"'{prefix}{n}'" for n in close[:3]) + "?"
    elif known:
        msg += "; defined here: " + ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    else:
        msg += "; nothing is defined there"
    err = UnknownParamError(f"{context}: {msg}" if context else msg)
    err.key, err.path, err.suggestions = key, prefix + key, [prefix + n for n in close[:3]]
    return err


def _top_level_indexes(text: str, sep: str) -> list[int]:
    """Positions of `sep` outside quotes and (), [], {} nesting."""
    found, depth, quote, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1  # an escaped quote does not close the string
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            found.append(i)
        i += 1
    return found


def parse_overrides(spec: str) -> list[tuple[str, str]]:
    """Splits "a.b=1,c=[1, 2],e='x,y'" into (key, value text) pairs, keeping commas inside brackets and quotes."""
    pairs, start = [], 0
    for end in _top_level_indexes(spec, ",") + [len(spec)]:
        entry, start = spec[start:end].strip(), end + 1
        if not entry:
            continue
        key, eq, value = entry.partition("=")
        if not eq or not key.strip():
            raise ParamsError(f"bad override {entry!r}: expected KEY=VALUE, e.g. train.learning_rate=0.1")
        pairs.append((key.strip(), value.strip()))
    return pairs


# ----------------------------------------------------------------------------------------------------- values

def _is_code_ref(value: Any) -> bool:
    return isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))


def _is_tf_dtype(value: Any) -> bool:
    # Duck-typed so that this module never needs TensorFlow just to look at a value.
    return (not isinstance(value, type) and type(value).__module__.startswith("tensorflow")
            and hasattr(value, "as_datatype_enum"))


def _resolve_dotted(dotted: str) -> Any:
    """Imports `pkg.module.Outer.Inner` (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    if parts[0] == "tf" and len(parts) == 2:
        import tensorflow as tf  # noqa: PLC0415 -- deferred: only texts holding a dtype pay for TensorFlow
        try:
            return tf.dtypes.as_dtype(parts[1])
        except TypeError:
            raise ParamsError(f"unknown TensorFlow dtype {dotted!r}") from None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means try a shorter one; a broken import inside it is real.
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue
            raise ParamsError(f"cannot import {dotted!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - any failure inside user code becomes one readable error
            raise ParamsError(f"cannot import {dotted!r}: {type(e).__name__}: {e}") from None
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise ParamsError(f"cannot resolve {dotted!r}: {obj.__name__!r} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        if not _is_code_ref(obj):
            raise ParamsError(f"{dotted!r} is a {type(obj).__name__}, not a class or function")
        return obj
    raise ParamsError(f"cannot resolve {dotted!r}: no importable module in it")


def _code_path(obj: Any, path: str) -> str:
    dotted = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', '<?>')}"
    try:
        found = None if "<" in dotted else _resolve_dotted(dotted)
    except ParamsError:
        found = None
    if found is not obj:
        raise ParamsError(f"{path}: cannot write {obj!r} as text: {dotted} is not importable (only module-level "
                          "classes and functions, and classes nested in them, are; no lambdas or local classes)")
    return dotted


def _format(value: Any, path: str, strict: bool = True) -> str:
    """Writes a value as a literal that `_build` reads back; nested Params become placeholders."""
    kind = type(value)
    if kind in _SCALARS:
        return repr(value)
    if kind is float:
        if math.isnan(value) or math.isinf(value):
            return f"float('{value}')"
        return repr(value)
    if kind in (list, tuple):
        items = [_format(v, f"{path}[{i}]", strict) for i, v in enumerate(value)]
        if kind is list:
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if kind is dict:
        return "{" + ", ".join(f"{_format(k, path, strict)}: {_format(v, f'{path}[{k!r}]', strict)}"
                               for k, v in value.items()) + "}"
    if kind is Params:
        return "Params()"
    if kind is InstantiableParams:
        return f"InstantiableParams({_format(value.cls, path + '.cls', strict)})"
    if _is_tf_dtype(value):
        return f"tf.{value.name}"
    try:
        if _is_code_ref(value):
            return _code_path(value, path)
        raise ParamsError(f"{path}: cannot write a {kind.__name__} as text: {value!r}")
    except ParamsError:
        if strict:
            raise
        return repr(value)


def _dotted_name(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or not names:
        return None
    return ".".join([node.id] + names[::-1])


def _build(node: ast.AST, allow_params: bool = True, resolve_names: bool = True) -> Any:
    """Reads one literal from its AST: constants, containers, float('inf'), import paths, Params placeholders."""
    if isinstance(node, ast.Constant) and isinstance(node.value, _SCALARS + (float,)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = _build(node.operand, False, False)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = [_build(e, allow_params, resolve_names) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    elif isinstance(node, ast.Dict) and None not in node.keys:
        try:
            return {_build(k, False, False): _build(v, allow_params, resolve_names)
                    for k, v in zip(node.keys, node.values)}
        except TypeError as e:  # an unhashable key such as a list
            raise ParamsError(f"bad dict key: {e}") from None
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name, args = node.func.id, node.args
        if (name == "float" and len(args) == 1 and isinstance(args[0], ast.Constant)
                and args[0].value in ("inf", "-inf", "nan")):
            return float(args[0].value)
        if allow_params and name == "Params" and not args:
            return Params()
        if allow_params and name == "InstantiableParams" and len(args) == 1:
            return InstantiableParams(_build(args[0], False, True))
    elif isinstance(node, ast.Attribute) and resolve_names and _dotted_name(node):
        return _resolve_dotted(_dotted_name(node))
    raise ParamsError(f"unsupported value {ast.unparse(node)!r} (expected a literal, a class or function "
                      "import path, tf.<dtype> or a Params placeholder)")


def _parse_path(text: str, item_last: bool = False) -> list[tuple[str, Any]]:
    """'a.b[2].c' -> [('attr', 'a'), ('attr', 'b'), ('item', 2), ('attr', 'c')]; 'a.b[2]' only if `item_last`."""
    parts = text.split(".")
    if all(p.isidentifier() for p in parts):  # the common case needs no AST
        return [("attr", p) for p in parts]
    try:
        node = ast.parse(text.strip(), mode="eval").body
        segments = []
        while not isinstance(node, ast.Name):
            if isinstance(node, ast.Attribute):
                segments.append(("attr", node.attr))
            elif isinstance(node, ast.Subscript):
                segments.append(("item", _build(node.slice, False, False)))
            else:
                raise ParamsError("not a path")
            node = node.value
        segments.append(("attr", node.id))
    except (SyntaxError, ValueError):
        raise ParamsError(f"bad param path {text!r} (expected names joined by dots, e.g. task.hidden_dim)") from None
    if segments[0][0] != "attr" and not item_last:
        raise ParamsError(f"bad param path {text!r}: it must end in a name")
    return segments[::-1]


def _children(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, element) of a container, with the subscript paths used in text."""
    if type(value) in (list, tuple):
        yield from ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif type(value) is dict:
        yield from ((f"{path}[{k!r}]", v) for k, v in value.items())


def _params_inside(value: Any, path: str) -> Iterator[tuple[str, Params]]:
    """Every Params that is `value` or sits (at any depth) in its lists, tuples and dicts, in order."""
    if isinstance(value, Params):
        yield path, value
    for sub_path, sub in _children(value, path):
        yield from _params_inside(sub, sub_path)


def _same(a: Any, b: Any) -> bool:
    # Stricter than ==: 1, 1.0 and True differ (types must survive round trips), and nan equals nan.
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _copy_value(value: Any) -> Any:
    if isinstance(value, Params):
        new = type(value).__new__(type(value))
        Params.__init__(new)  # not type(value).__init__: InstantiableParams would redefine 'cls'
        new._values = {k: _copy_value(v) for k, v in value._values.items()}
        new._docs = dict(value._docs)
        return new
    if type(value) in (list, tuple):
        return type(value)(_copy_value(v) for v in value)
    if type(value) is dict:
        return {k: _copy_value(v) for k, v in value.items()}
    if _is_code_ref(value) or _is_tf_dtype(value) or isinstance(value, types.ModuleType):
        return value  # shared on purpose: identity is what makes a class or dtype meaningful
    return _copy.deepcopy(value)


def _merge(existing: Any, template: Any) -> Any:
    """Value after loading `template` over `existing`: existing Params nodes (and their docs) are kept."""
    if isinstance(template, Params):
        if type(existing) is not type(template):
            return template
        if isinstance(template, InstantiableParams) and existing.cls is not template.cls:
            existing.cls = template.cls
        return existing
    if type(template) in (list, tuple) and type(existing) in (list, tuple) and len(existing) == len(template):
        return type(template)(_merge(e, t) for e, t in zip(existing, template))
    if type(template) is dict and type(existing) is dict and existing.keys() == template.keys():
        return {k: _merge(existing[k], t) for k, t in template.items()}
    return template


def _walk(node: Any, segments: list[tuple[str, Any]], dotted: str) -> Any:
    """The value `segments` (of `_parse_path`) lead to from `node`; ParamsError naming `dotted` where none is."""
    for kind, key in segments:
        if kind == "attr" and isinstance(node, Params) and key in node._values:
            node = node._values[key]
        elif kind == "item" and isinstance(node, (list, tuple, dict)):
            try:
                node = node[key]
            except (LookupError, TypeError):
                raise ParamsError(f"no '{dotted}': no item [{key!r}] there") from None
        else:
            raise ParamsError(f"no '{dotted}': nothing named {key!r} there")
    return node


_ABSENT = object()  # a path one side of a comparison lacks


class _Node(str):
    """A diff entry standing for a Params node or a container of them (shown as is, not quoted)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Override rules, first match on the current value wins (bool before int, class before function):
# (matches current, type name, example text, accepts parsed value, converts accepted value).
_KINDS = [
    (lambda c: isinstance(c, bool), "bool", "True", lambda v: isinstance(v, bool), None),
    (lambda c: isinstance(c, int), "int", "1", lambda v: _is_number(v) and isinstance(v, int), None),
    (lambda c: isinstance(c, float), "float", "0.001", _is_number, float),
    (lambda c: isinstance(c, list), "list", "[1, 2]", lambda v: type(v) in (list, tuple), list),
    (lambda c: isinstance(c, tuple), "tuple", "(1, 2)", lambda v: type(v) in (list, tuple), tuple),
    (lambda c: isinstance(c, dict), "dict", "{'key': 1}", lambda v: isinstance(v, dict), None),
    (lambda c: isinstance(c, type), "class", "some.module.SomeClass", lambda v: isinstance(v, type), None),
    (_is_code_ref, "function", "some.module.some_function", _is_code_ref, None),
    (_is_tf_dtype, "tf.DType", "tf.float32", _is_tf_dtype, None),
]


@functools.cache
def _reserved(cls: type) -> frozenset[str]:
    # Fields are read as attributes, so a field may not hide a method; 'cls' belongs to InstantiableParams.
    return frozenset(n for n in dir(cls) if not n.startswith("_")) | {"cls"}


# ----------------------------------------------------------------------------------------------------- Params

class Params:
    """A tree of named, documented hyper-parameters (Lingvo's Params idea)."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._docs: dict[str, str] = {}
        self._frozen = False

    def define(self, name: str, default: Any, doc: str) -> None:
        """Adds field `name` with a default value and a doc string."""
        if self._frozen:
            raise ParamsError(f"cannot define '{name}': these params are frozen; use .copy() for a mutable copy")
        if name in self._values:
            raise ParamsError(f"param '{name}' is already defined (doc: {self._docs[name]!r}); set it instead")
        if (not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name)
                or name.startswith("_")):
            raise ParamsError(f"bad param name {name!r}: use a Python identifier not starting with '_'")
        if name in _reserved(type(self)):
            raise ParamsError(f"bad param name '{name}': it is reserved by {type(self).__name__}")
        self._define_field(name, default, doc)

    def _define_field(self, name: str, default: Any, doc: str) -> None:
        self._values[name] = default
        self._docs[name] = str(doc)

    def _check_mutable(self, key: str) -> None:
        if self._frozen:
            raise ParamsError(f"cannot set '{key}': these params are frozen; use .copy() for a mutable copy")

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Private names must fail plainly: copy and pickle probe
        # them before __init__ has run, when _values does not exist yet.
        values = self.__dict__.get("_values")
        if name.startswith("_") or values is None:
            raise AttributeError(name)
        if name in values:
            return values[name]
        raise _unknown(name, list(values))

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self._values:
            self._check_mutable(name)
            self._values[name] = value
        else:
            raise _unknown(name, list(self._values))

    def __dir__(self) -> list[str]:
        return list(super().__dir__()) + list(self._values)

    def _locate(self, dotted: str | list, must_exist: bool = True, context: str = "") -> tuple[Params, str, str]:
        """(parent node, final name, dotted prefix of the parent) for a path like 'a.b[2].c' (or its segments)."""
        segments = _parse_path(dotted) if isinstance(dotted, str) else dotted
        where = f"{context}: " if context else ""
        node: Any = self
        shown = ""
        for kind, key in segments[:-1]:
            if kind == "item":
                try:
                    node = node[key]
                except (LookupError, TypeError):
                    raise ParamsError(f"{where}'{shown}' has no item [{key!r}]") from None
                shown += f"[{key!r}]"
                continue
            if not isinstance(node, Params):
                raise ParamsError(f"{where}'{shown}' is a {type(node).__name__}, "
                                  f"not Params, so it has no '{key}'")
            if key not in node._values:
                raise _unknown(key, list(node._values), shown + "." if shown else "", context)
            node, shown = node._values[key], f"{shown}.{key}" if shown else key
        name = segments[-1][1]
        prefix = shown + "." if shown else ""
        if not isinstance(node, Params):
            raise ParamsError(f"{where}'{shown}' is a {type(node).__name__}, "
                              f"not Params, so it has no '{name}'")
        if must_exist and name not in node._values:
            raise _unknown(name, list(node._values), prefix, context)
        return node, name, prefix

    def set(self, **kwargs: Any) -> Params:
        """Sets fields by name or dotted path, all or none; returns self for chaining."""
        targets = [(self._locate(key), value) for key, value in kwargs.items()]
        for (parent, name, prefix), _ in targets:
            parent._check_mutable(prefix + name)
        for (parent, name, _), value in targets:
            parent._values[name] = value
        return self

    def set_dotted(self, dotted: str, value: Any) -> Params:
        """Sets the field at a dotted path such as 'task.encoder.dim'; returns self."""
        return self.set(**{dotted: value})

    def get(self, dotted: str) -> Any:
        """The value at a dotted path such as 'task.encoder.dim'."""
        parent, name, _ = self._locate(dotted)
        return parent._values[name]

    def doc(self, name: str) -> str:
        """The doc string of a field (a name or a dotted path)."""
        parent, name, _ = self._locate(name)
        return parent._docs[name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._locate(name)
        except ParamsError:
            return False
        return True

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self._values.items()))

    def keys(self) -> list[str]:
        """Field names in definition order."""
        return list(self._values)

    def items(self) -> list[tuple[str, Any]]:
        """(name, value) pairs in definition order."""
        return list(self._values.items())

    def copy(self) -> Params:
        """A deep, unfrozen copy; classes, functions and dtypes are shared, not copied."""
        return _copy_value(self)

    def freeze(self) -> Params:
        """Makes this tree read-only, including Params nested in fields, lists, tuples and dicts; returns self.

        Container values themselves stay plain Python lists and dicts: freezing guards the fields, not their contents.
        """
        self._frozen = True
        for _, node in _params_inside(list(self._values.values()), ""):
            node.freeze()
        return self

    @property
    def is_frozen(self) -> bool:
        """Whether this node rejects changes."""
        return self._frozen

    def _flatten(self, with_nodes: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def visit(value: Any, path: str) -> None:
            if isinstance(value, Params):
                if with_nodes and path:
                    out[path] = _Node(_format(value, path, strict=False))
                for name, v in value._values.items():
                    visit(v, f"{path}.{name}" if path else name)
            elif any(True for _ in _params_inside(value, path)):
                if with_nodes:
                    out[path] = _Node(f"{type(value).__name__} of {len(value)}")
                for sub_path, sub in _children(value, path):
                    visit(sub, sub_path)
            else:
                out[path] = value

        visit(self, "")
        return out

    def flatten(self) -> dict[str, Any]:
        """Dotted path -> leaf value, in definition order, entering nested Params and lists/tuples/dicts of them."""
        return self._flatten(with_nodes=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Params):
            return NotImplemented
        return (type(self) is type(other) and self._values.keys() == other._values.keys()
                and all(_same(v, other._values[k]) for k, v in self._values.items()))

    __hash__ = None  # mutable, so unhashable

    def diff(self, other: Params) -> list[str]:
        """Readable differences: 'a.b: 64 -> 128', 'only in self: x.y', 'only in other: z' (what a node only one
        side has holds is listed too)."""
        lines = []
        for path, here, there in self.differences(other, whole_nodes=False):
            if there is None:
                lines.append(f"only in self: {path}")
            elif here is None:
                lines.append(f"only in other: {path}")
            else:
                lines.append(f"{path}: {here} -> {there}")
        return lines

    def differences(self, other: Params, whole_nodes: bool = True) -> list[tuple[str, str | None, str | None]]:
        """(path, value here, value in `other`) of each field that differs, values as text, None standing for the
        side that lacks it. With `whole_nodes`, a node only one side has, or of another class or length on each, is
        one entry: what it holds is not listed again."""
        mine, theirs = self._flatten(with_nodes=True), other._flatten(with_nodes=True)

        def show(v: Any) -> str:
            return v if isinstance(v, _Node) else _format(v, "", strict=False)

        out: list[tuple[str, str | None, str | None]] = []
        whole: list[str] = []  # nodes listed as one entry
        for path in [*mine, *(p for p in theirs if p not in mine)]:
            if any(path.startswith((top + ".", top + "[")) for top in whole):
                continue
            here, there = mine.get(path, _ABSENT), theirs.get(path, _ABSENT)
            if here is not _ABSENT and there is not _ABSENT and _same(here, there):
                continue
            out.append((path, None if here is _ABSENT else show(here), None if there is _ABSENT else show(there)))
            if whole_nodes and (isinstance(here, _Node) or isinstance(there, _Node)):
                whole.append(path)
        return out

    def is_class_default(self, dotted: str) -> bool:
        """Whether the value at `dotted` ('a.b', 'a.layers[2]') equals its default: its value in the `params()` of the
        class of the nearest InstantiableParams above it (False when no class above it gives defaults, or none for
        this field or item). ParamsError when `dotted` leads nowhere in this tree."""
        segments = _parse_path(dotted, item_last=True)
        owner, rest, value = None, segments, self
        for i, segment in enumerate(segments):
            if isinstance(value, InstantiableParams):
                owner, rest = value, segments[i:]
            value = _walk(value, [segment], dotted)
        defaults = None if owner is None else _default_params(owner.cls)
        if defaults is None:
            return False
        try:
            return _same(value, _walk(defaults, rest, dotted))
        except ParamsError:
            return False

    # ------------------------------------------------------------------------------------------------ text

    def to_text(self, docs: bool = False) -> str:
        """One `path : value` line per field in definition order (docs as '#' comments if asked)."""
        return "\n".join(self._text_lines(strict=True, docs=docs))

    def _text_lines(self, strict: bool, docs: bool) -> list[str]:
        lines: list[str] = []

        def emit(node: Params, prefix: str) -> None:
            for name, value in node._values.items():
                if prefix and name == "cls" and isinstance(node, InstantiableParams):
                    continue  # written in the node's header line
                path = prefix + name
                if docs and node._docs[name]:
                    lines.extend("# " + line for line in node._docs[name].splitlines())
                lines.append(f"{path} : {_format(value, path, strict)}")
                for sub_path, sub in _params_inside(value, path):
                    emit(sub, sub_path + ".")

        emit(self, "")
        return lines

    def __repr__(self) -> str:
        # Never raises, unlike to_text: unwritable values (a lambda) are shown with repr().
        return "\n".join(self._text_lines(strict=False, docs=False))

    __str__ = __repr__

    @staticmethod
    def _parse_text(text: str) -> list[tuple[str, list[tuple[str, Any]], ast.AST]]:
        """(context naming the line, path segments, value AST) per non-comment line."""
        entries = []
        for number, line in enumerate(text.split("\n"), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            context = f"line {number} ({stripped!r})"
            colons = _top_level_indexes(stripped, ":")
            if not colons:
                raise ParamsError(f"{context}: expected 'path : value'")
            try:
                segments = _parse_path(stripped[:colons[0]].strip())
                value_text = stripped[colons[0] + 1:].strip()
                node = ast.parse(value_text, mode="eval").body
            except (SyntaxError, ValueError) as e:
                reason = e.msg if isinstance(e, SyntaxError) else str(e)
                raise ParamsError(f"{context}: {reason}") from None
            entries.append((context, segments, node))
        return entries

    def _apply_text(self, entries: list, fresh: dict[int, Params]) -> None:
        # Nodes created by this load (ids in `fresh`) take new fields; existing nodes only take known ones.
        for context, segments, node in entries:
            try:
                template = _build(node)
            except ParamsError as e:
                raise ParamsError(f"{context}: {e}") from None
            fresh.update((id(p), p) for _, p in _params_inside(template, ""))
            parent, name, prefix = self._locate(segments, must_exist=False, context=context)
            if name in parent._values:
                parent._check_mutable(prefix + name)
                parent._values[name] = _merge(parent._values[name], template)
            elif id(parent) in fresh:
                try:
                    parent.define(name, template, "")
                except ParamsError as e:
                    raise ParamsError(f"{context}: {e}") from None
            else:
                raise _unknown(name, list(parent._values), prefix, context)

    @classmethod
    def from_text(cls, text: str) -> Params:
        """Parses `to_text` output. The root type comes from the text: a top-level `cls` line makes it
        InstantiableParams, else Params. Fields get empty docs."""
        entries = cls._parse_text(text)
        root: Params = Params()
        for context, segments, node in entries:
            if segments == [("attr", "cls")]:
                try:
                    built = _build(node, allow_params=False)
                    if not _is_code_ref(built):
                        raise ParamsError(f"a top-level cls must be a class or function, not {built!r}")
                except ParamsError as e:
                    raise ParamsError(f"{context}: {e}") from None
                root = InstantiableParams(built)
        root._apply_text(entries, {id(root): root})
        return root

    def update_from_text(self, text: str) -> Params:
        """Applies every line of a text to this existing tree, all or none; every key must exist. Returns self."""
        if self._frozen:
            raise ParamsError("cannot update frozen params from text; use .copy() for a mutable copy")
        entries = self._parse_text(text)
        self.copy()._apply_text(entries, {})  # a dry run, so an error leaves self untouched
        self._apply_text(entries, {})
        return self

    def override(self, dotted: str, text_value: str, notes: list[str] | None = None) -> Params:
        """Sets an existing field from command-line text, type-checked against its current value; returns self.

        Naming a class (`X=path`, `X.cls=path` or a short name such as `schedule=interleaved`) keeps the node as
        it is when it already has that class; another class replaces it by that class's default Params, and one
        line naming the fields so reset (those that differed from the old class's defaults) is appended to `notes`.
        """
        parent, name, prefix = self._locate(dotted)
        key, text, current = prefix + name, text_value.strip(), parent._values[name]
        parent._check_mutable(key)
        if isinstance(current, InstantiableParams):
            # A class path or a name the current class knows: the node becomes that class's default Params, whose
            # fields the same override string may set after it.
            replacement = _replacement_node(current, text, key)
            if replacement is not current:
                _note_reset(notes, f"{key}={text}", current, replacement)
                parent._values[name] = replacement
            return self
        if isinstance(current, Params):
            raise ParamsError(f"{key}: cannot set {text!r} (it is a nested {type(current).__name__}; "
                              f"override its fields, e.g. {key}.<field>=...)")
        try:
            # Strings never resolve import paths: 'data.path=os.path' must not import anything.
            value, parsed = _build(ast.parse(text, mode="eval").body, False, not isinstance(current, str)), True
        except (SyntaxError, ValueError):
            value, parsed = None, False
        if isinstance(current, str):
            # Unquoted words, numbers and paths are all taken as the text itself (optimizer=adam, run=007); True and
            # False are the bools, for a field that takes a word or a bool (batch_weight_gradients='auto' or True).
            value = value if parsed and isinstance(value, (str, bool)) else text
        elif current is None:
            value = value if parsed else text
        elif parsed and value is None and _defaults_to_none(parent, name):
            pass  # an optional field (its class's default is None) set back to None, e.g. balance=None
        else:
            _, kind, example, accepts, convert = next(
                (k for k in _KINDS if k[0](current)),
                (None, type(current).__name__, _format(current, "", strict=False),
                 lambda v: isinstance(v, type(current)), None))
            if not parsed or not accepts(value):
                raise ParamsError(f"{key}: cannot set {text!r} (expected {kind}, e.g. {key}={example})")
            value = convert(value) if convert else value
        if name == "cls" and isinstance(parent, InstantiableParams) and value is not current:
            defaults = _default_params(value)
            if defaults is not None:
                # Another class's fields are not this one's: keeping FillDrain's fields under Interleaved would
                # refuse 'virtual_stages' and keep 'parallel_iterations' it does not honour.
                _note_reset(notes, f"{key}={text}", parent, defaults)
                parent._values, parent._docs = defaults._values, defaults._docs
                return self
        parent._values[name] = value
        return self


def _defaults_to_none(node: Params, name: str) -> bool:
    """Whether field `name` of `node` is None in the default Params of `node`'s class (an optional field)."""
    defaults = _default_params(node.cls) if isinstance(node, InstantiableParams) else None
    return defaults is not None and name in defaults._values and defaults._values[name] is None


def _default_params(cls: Any) -> InstantiableParams | None:
    """`cls.params()` when `cls` is a class whose `params()` classmethod gives its own InstantiableParams, else None."""
    if not isinstance(cls, type) or not isinstance(inspect.getattr_static(cls, "params", None), classmethod):
        return None
    defaults = cls.params()
    return defaults if isinstance(defaults, InstantiableParams) and defaults.cls is cls else None


def _class_name(cls: Any) -> str:
    return getattr(cls, "__name__", repr(cls))


def _set_fields(node: InstantiableParams) -> list[str]:
    """`field=value` of each field of `node` (nested ones by dotted path) whose value is not the default that
    `node.cls.params()` gives; every field when the class gives no defaults."""
    defaults = _default_params(node.cls)
    base = defaults._flatten(with_nodes=True) if defaults is not None else {}
    return [f"{path}={_format(value, path, strict=False)}" for path, value in node._flatten(with_nodes=True).items()
            if path != "cls" and not isinstance(value, _Node) and not (path in base and _same(value, base[path]))]


def _note_reset(notes: list[str] | None, override: str, old: InstantiableParams, new: InstantiableParams) -> None:
    """Appends to `notes` the line saying which settings of `old` the override replacing it by `new` drops."""
    if notes is None:
        return
    dropped = _set_fields(old)
    if not dropped:
        return
    old_name, new_name = _class_name(old.cls), _class_name(new.cls)
    notes.append(f"{override} replaces {old_name} by {new_name} at its defaults, so what was set on {old_name} is "
                 f"reset: {', '.join(dropped)} (set {new_name}'s fields after the class in --params)")


def _replacement_node(current: InstantiableParams, text: str, key: str) -> InstantiableParams:
    """The node an override `key=text` puts in place of `current`: a class path gives that class's default
    Params; another word is looked up by `current.cls.named_params(word)` (e.g. a schedule's short name).
    `current` itself when the class named is the one it has: its fields stay as the experiment and the overrides
    before set them."""
    word = text.strip()
    if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"":
        word = word[1:-1]
    if "." in word:
        try:
            cls = _resolve_dotted(word)
        except ParamsError as e:
            raise ParamsError(f"{key}={text}: {e}") from None
        if cls is current.cls:
            return current
        defaults = _default_params(cls)
        if defaults is None:
            raise ParamsError(f"{key}={text}: {word} has no params() classmethod giving its default Params; "
                              f"set {key}.cls={word} to change only the class")
        return defaults
    by_name = getattr(current.cls, "named_params", None)
    if not word.isidentifier() or by_name is None:
        raise ParamsError(f"{key}: cannot set {text!r} (it is a nested {type(current).__name__} of "
                          f"{_class_name(current.cls)}; give a class path, e.g. "
                          f"{key}=some.module.SomeClass, or override its fields, e.g. {key}.<field>=...)")
    try:
        named = by_name(word)
    except ParamsError as e:
        raise ParamsError(f"{key}={text}: {e}") from None
    return current if named.cls is current.cls else named


class InstantiableParams(Params):
    """Params that also name the class they build: p.instantiate() -> p.cls(p)."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self._define_field("cls", cls, "The class that instantiate() builds.")

    def instantiate(self, *args: Any, **kwargs: Any) -> Any:
        """Builds `self.cls(self, *args, **kwargs)`."""
        return self.cls(self, *args, **kwargs)
