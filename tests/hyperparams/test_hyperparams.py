"""Tests for gpipe_tf.hyperparams: Params trees, text round trips, freezing and command-line overrides."""

import math
import os
import subprocess
import sys

import pytest

from gpipe_tf.hyperparams import InstantiableParams, Params, ParamsError, UnknownParamError, parse_overrides
from tests.helpers.paths import ROOT


class Builder:
    """A class built by InstantiableParams in these tests."""

    def __init__(self, params, *args, **kwargs):
        self.params, self.args, self.kwargs = params, args, kwargs


class Outer:
    """Holds a nested class, written in text by its qualified name."""

    class Inner:
        """A nested class."""


def relu(x):
    """A module-level function, written in text by its import path."""
    return max(x, 0)


def _full_tree() -> Params:
    """Three levels holding every supported value type."""
    leaf = Params()
    leaf.define("dim", 64, "an int")
    leaf.define("scale", 1.0, "a float that looks like an int")
    leaf.define("neg", -3.5e-7, "a small negative float")
    leaf.define("big", float("inf"), "infinity")
    leaf.define("small", float("-inf"), "minus infinity")
    leaf.define("flag", False, "a bool")
    leaf.define("text", "it's \"quoted\", a, b # not a comment\nline 2 \u00e9\u4e2d", "a hard string")
    leaf.define("empty", "", "an empty string")
    leaf.define("nothing", None, "None")
    leaf.define("act", relu, "a function")
    leaf.define("inner_cls", Outer.Inner, "a nested class")
    leaf.define("builtin", len, "a builtin function")
    leaf.define("raw", b"\x00bytes", "bytes")

    mid = Params()
    mid.define("dims", [64, -1, [2, 3]], "a nested list")
    mid.define("one", (7,), "a 1-tuple")
    mid.define("none", (), "an empty tuple")
    mid.define("table", {"a": 1, "b": [1.5, None], "c": {"d": (True,)}}, "a nested dict")
    mid.define("leaf", leaf, "the third level")
    mid.define("empty_child", Params(), "an empty nested Params")
    layer = InstantiableParams(Builder)
    layer.define("units", 3, "units")
    mid.define("layer", layer, "an InstantiableParams")
    in_list = Params()
    in_list.define("k", 1, "k")
    in_list_layer = InstantiableParams(Outer.Inner)
    in_list_layer.define("rate", 0.5, "rate")
    mid.define("stack", [in_list, 3, in_list_layer], "Params inside a list")
    tuple_child = Params()
    tuple_child.define("z", "zz", "z")
    mid.define("pair", (tuple_child,), "Params inside a 1-tuple")

    root = Params()
    root.define("name", "exp", "a str")
    root.define("steps", 10, "an int")
    root.define("builder", Builder, "a class")
    root.define("task", mid, "the second level")
    return root


def test_round_trip_every_type_is_exact():
    p = _full_tree()
    text = p.to_text()
    q = Params.from_text(text)
    assert q == p
    assert q.to_text() == text
    assert q.diff(p) == []


def test_round_trip_preserves_types_and_identity_of_code():
    q = Params.from_text(_full_tree().to_text())
    leaf = q.task.leaf
    assert type(leaf.dim) is int and type(leaf.scale) is float and leaf.scale == 1.0
    assert leaf.big == math.inf and leaf.small == -math.inf
    assert leaf.flag is False and leaf.nothing is None and leaf.raw == b"\x00bytes"
    assert leaf.text == "it's \"quoted\", a, b # not a comment\nline 2 \u00e9\u4e2d"
    assert leaf.act is relu and leaf.inner_cls is Outer.Inner and leaf.builtin is len
    assert q.builder is Builder
    assert q.task.one == (7,) and type(q.task.one) is tuple and q.task.none == ()
    assert q.task.table["c"]["d"] == (True,)
    assert type(q.task.layer) is InstantiableParams and q.task.layer.cls is Builder
    assert q.get("task.stack")[2].cls is Outer.Inner and q.task.stack[2].rate == 0.5
    assert q.task.pair[0].z == "zz"
    assert type(q.task.empty_child) is Params and q.task.empty_child.keys() == []


def test_text_is_readable_lines_in_definition_order():
    text = _full_tree().to_text()
    lines = text.splitlines()
    assert lines[:4] == ["name : 'exp'", "steps : 10",
                         "builder : tests.hyperparams.test_hyperparams.Builder", "task : Params()"]
    assert "task.layer : InstantiableParams(tests.hyperparams.test_hyperparams.Builder)" in lines
    assert "task.stack : [Params(), 3, InstantiableParams(tests.hyperparams.test_hyperparams.Outer.Inner)]" in lines
    assert "task.stack[2].rate : 0.5" in lines
    assert "task.leaf.act : tests.hyperparams.test_hyperparams.relu" in lines
    assert "task.leaf.big : float('inf')" in lines
    assert "task.layer.cls" not in text  # the header line carries it


def test_from_text_skips_comments_and_blank_lines_and_docs_can_be_written():
    p = Params()
    p.define("lr", 0.1, "Learning rate.\nSecond line.")
    text = p.to_text(docs=True)
    assert text.splitlines()[:2] == ["# Learning rate.", "# Second line."]
    assert Params.from_text("\n# header\n  \n" + text + "\n") == p


def test_top_level_instantiable_params_round_trip():
    p = InstantiableParams(Builder)
    p.define("units", 4, "units")
    q = Params.from_text(p.to_text())
    assert type(q) is InstantiableParams and q.cls is Builder and q == p


def test_tf_dtype_round_trip():
    import tensorflow as tf

    p = Params()
    p.define("dtype", tf.float32, "compute dtype")
    p.define("dtypes", [tf.bfloat16, tf.int64], "a list of dtypes")
    assert p.to_text() == "dtype : tf.float32\ndtypes : [tf.bfloat16, tf.int64]"
    q = Params.from_text(p.to_text())
    assert q == p and q.dtype == tf.float32
    assert p.copy().dtype is tf.float32
    q.override("dtype", "tf.float16")
    assert q.dtype == tf.float16
    with pytest.raises(ParamsError, match=r"expected tf\.DType, e\.g\. dtype=tf\.float32"):
        q.override("dtype", "3")


def test_module_import_and_text_do_not_need_tensorflow():
    # Loaded from its file in a fresh interpreter, so the package's other modules cannot pull TensorFlow in.
    path = os.path.join(ROOT, "gpipe_tf", "hyperparams.py")
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('hp', {path!r})\n"
            "hp = importlib.util.module_from_spec(spec); spec.loader.exec_module(hp)\n"
            "p = hp.Params(); p.define('x', [1, (2,)], 'x'); p.define('f', len, 'f')\n"
            "assert hp.Params.from_text(p.to_text()) == p\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_to_text_rejects_unimportable_code_naming_the_path():
    class Local:
        pass

    p = Params()
    p.define("child", Params(), "child")
    p.child.define("fn", lambda x: x, "a lambda")
    with pytest.raises(ParamsError, match=r"child\.fn: .*lambda"):
        p.to_text()
    p.child.fn = Local
    with pytest.raises(ParamsError, match=r"child\.fn: .*Local"):
        p.to_text()
    assert "child.fn : " in repr(p)  # repr never raises


@pytest.mark.parametrize("text, line", [
    ("a : 1\nb 2", "line 2 ('b 2')"),
    ("a : 1\n\nb : [1, 2", "line 3 ('b : [1, 2')"),
    ("a : os.system('x')", "line 1"),
    ("a : no_such_module_xyz.Thing", "line 1"),
    ("a : 1\na.b : 2", "line 2 ('a.b : 2')"),
    ("x.y : 1", "line 1 ('x.y : 1')"),
    ("a-b : 1", "line 1 ('a-b : 1')"),
])
def test_malformed_text_names_the_line(text, line):
    with pytest.raises(ParamsError) as info:
        Params.from_text(text)
    assert line in str(info.value)


def test_update_from_text_applies_to_existing_tree_and_keeps_docs():
    p = _full_tree()
    saved = p.copy().set(**{"steps": 99, "task.leaf.dim": 7, "task.stack": [p.task.stack[0], 4, p.task.stack[2]]})
    saved.task.stack[0].k = 5
    assert p.update_from_text(saved.to_text()) is p
    assert p == saved
    assert p.doc("task.leaf.dim") == "an int"
    assert p.task.stack[0].k == 5 and p.doc("task.stack") == "Params inside a list"


def test_update_from_text_unknown_key_suggests_and_changes_nothing():
    p = _full_tree()
    before = p.copy()
    with pytest.raises(UnknownParamError, match=r"did you mean 'task\.leaf\.dim'\?") as info:
        p.update_from_text("steps : 5\ntask.leaf.dmi : 3")
    assert "line 2" in str(info.value)
    assert p == before


def test_freeze_is_recursive():
    p = _full_tree().freeze()
    assert p.is_frozen and p.task.leaf.is_frozen and p.task.stack[0].is_frozen and p.task.pair[0].is_frozen
    with pytest.raises(ParamsError, match=r"frozen.*\.copy\(\)"):
        p.task.leaf.dim = 1
    with pytest.raises(ParamsError, match="frozen"):
        p.task.stack[0].k = 2
    with pytest.raises(ParamsError, match="frozen"):
        p.set(**{"task.leaf.dim": 1})
    with pytest.raises(ParamsError, match="frozen"):
        p.override("steps", "3")
    with pytest.raises(ParamsError, match="frozen"):
        p.task.define("new", 1, "new")
    with pytest.raises(ParamsError, match="frozen"):
        p.update_from_text("steps : 3")
    assert p.task.leaf.dim == 64 and p.task.stack[0].k == 1 and p.steps == 10


def test_freeze_returns_self_and_copy_is_unfrozen():
    p = _full_tree()
    assert p.freeze() is p
    q = p.copy()
    assert not q.is_frozen and not q.task.leaf.is_frozen and not q.task.stack[0].is_frozen
    q.task.stack[0].k = 9
    assert p.task.stack[0].k == 1


@pytest.mark.parametrize("typo, suggestion", [("dmi", "task.leaf.dim"), ("dim_", "task.leaf.dim"),
                                              ("fag", "task.leaf.flag"), ("scael", "task.leaf.scale")])
def test_did_you_mean_on_get_and_set(typo, suggestion):
    p = _full_tree()
    for action in (lambda: p.get(f"task.leaf.{typo}"), lambda: p.set(**{f"task.leaf.{typo}": 1}),
                   lambda: p.set_dotted(f"task.leaf.{typo}", 1), lambda: p.override(f"task.leaf.{typo}", "1")):
        with pytest.raises(UnknownParamError) as info:
            action()
        message = str(info.value)
        assert f"'task.leaf.{typo}'" in message and f"did you mean '{suggestion}'" in message


def test_did_you_mean_on_attribute_access_and_short_names():
    p = Params()
    p.define("lr", 0.1, "learning rate")
    with pytest.raises(UnknownParamError, match=r"'lx'.*did you mean 'lr'\?"):
        p.lx  # noqa: B018 - the access itself must fail
    with pytest.raises(AttributeError, match=r"did you mean 'lr'\?"):
        p.rl = 0.2
    with pytest.raises(UnknownParamError, match=r"'lR'.*did you mean 'lr'\?"):
        p.get("lR")
    assert not hasattr(p, "nope") and getattr(p, "nope", 5) == 5
    with pytest.raises(ParamsError, match="not Params"):
        p.get("lr.x")


def test_unknown_without_close_match_lists_defined_names():
    p = Params()
    p.define("alpha", 1, "a")
    with pytest.raises(UnknownParamError, match="defined here: alpha"):
        p.get("zzzzzz")


def test_set_get_dotted_and_chaining():
    p = _full_tree()
    assert p.set(steps=5).set(**{"task.leaf.dim": 8}).set_dotted("task.stack[0].k", 3) is p
    assert p.get("steps") == 5 and p.task.leaf.dim == 8 and p.get("task.leaf.dim") == 8
    assert p.get("task.stack[0].k") == 3 and p.get("task.stack")[0].k == 3
    assert "task.leaf.dim" in p and "steps" in p and "task.leaf.nope" not in p and "nope" not in p


def test_set_is_all_or_nothing():
    p = _full_tree()
    with pytest.raises(UnknownParamError):
        p.set(steps=5, stepz=6)
    assert p.steps == 10


def test_private_attributes_behave_normally():
    p = Params()
    p._cache = {"a": 1}
    assert p._cache == {"a": 1} and "_cache" not in p.keys()
    with pytest.raises(AttributeError):
        p._missing  # noqa: B018


def test_copy_is_deep():
    p = _full_tree()
    q = p.copy()
    q.task.dims[2].append(4)
    q.task.table["b"].append(1)
    q.task.leaf.dim = 1
    q.task.stack[0].k = 2
    assert p.task.dims == [64, -1, [2, 3]] and p.task.table["b"] == [1.5, None]
    assert p.task.leaf.dim == 64 and p.task.stack[0].k == 1
    assert q.task.leaf.act is relu and q.builder is Builder
    assert q.doc("task.leaf.dim") == "an int" and type(q.task.layer) is InstantiableParams


def test_equality_ignores_order_and_docs_but_not_types():
    a, b = Params(), Params()
    a.define("x", 1, "doc a")
    a.define("y", [1, 2], "")
    b.define("y", [1, 2], "other doc")
    b.define("x", 1, "")
    assert a == b
    b.x = 1.0
    assert a != b
    b.x = True
    assert a != b
    ip = InstantiableParams(Builder)
    assert ip != Params() and Params() != ip
    assert ip == InstantiableParams(Builder) and ip != InstantiableParams(Outer.Inner)
    nan = Params()
    nan.define("v", float("nan"), "")
    assert nan == Params.from_text(nan.to_text())


def test_diff_lines():
    p = _full_tree()
    q = p.copy()
    q.task.leaf.dim = 128
    q.task.layer.cls = Outer.Inner
    q.name = "other"
    q.task.define("extra", 1, "")
    r = p.copy()
    r.task.leaf.define("only_here", None, "")
    assert p.diff(q) == [
        "name: 'exp' -> 'other'",
        "task.leaf.dim: 64 -> 128",
        "task.layer: InstantiableParams(tests.hyperparams.test_hyperparams.Builder) -> "
        "InstantiableParams(tests.hyperparams.test_hyperparams.Outer.Inner)",
        "task.layer.cls: tests.hyperparams.test_hyperparams.Builder -> tests.hyperparams.test_hyperparams.Outer.Inner",
        "only in other: task.extra",
    ]
    assert r.diff(p) == ["only in self: task.leaf.only_here"]
    empty = p.copy()
    empty.task.empty_child = 3
    assert p.diff(empty) == ["task.empty_child: Params() -> 3"]


def test_differences_name_each_field_with_its_value_on_each_side_and_a_whole_node_once():
    p = _full_tree()
    q = p.copy()
    q.task.leaf.dim = 128
    q.task.layer.cls = Outer.Inner  # another class: the node is one entry, not its cls and fields again
    q.task.define("extra", Params(), "")
    q.task.extra.define("inside", 1, "")
    r = p.copy()
    r.task.leaf.define("only_here", None, "")
    assert p.differences(q) == [
        ("task.leaf.dim", "64", "128"),
        ("task.layer", "InstantiableParams(tests.hyperparams.test_hyperparams.Builder)",
         "InstantiableParams(tests.hyperparams.test_hyperparams.Outer.Inner)"),
        ("task.extra", None, "Params()"),
    ]
    assert r.differences(p) == [("task.leaf.only_here", "None", None)]
    assert p.differences(p.copy()) == []


def test_flatten():
    flat = _full_tree().flatten()
    assert list(flat)[:4] == ["name", "steps", "builder", "task.dims"]
    assert flat["task.leaf.dim"] == 64 and flat["task.layer.cls"] is Builder
    assert flat["task.stack[0].k"] == 1 and flat["task.stack[1]"] == 3 and flat["task.stack[2].rate"] == 0.5
    assert flat["task.pair[0].z"] == "zz"
    assert "task.stack" not in flat and "task.leaf" not in flat


def test_iteration_keys_items_and_doc():
    p = Params()
    p.define("b", 1, "the b")
    p.define("a", 2, "the a")
    assert list(p) == [("b", 1), ("a", 2)] == p.items()
    assert p.keys() == ["b", "a"] and p.doc("a") == "the a"


def test_instantiate_builds_the_class_with_the_params():
    p = InstantiableParams(Builder)
    p.define("units", 3, "units")
    built = p.instantiate(1, name="x")
    assert isinstance(built, Builder) and built.params is p and built.args == (1,) and built.kwargs == {"name": "x"}
    assert p.doc("cls") == "The class that instantiate() builds."
    p.cls = Outer.Inner
    with pytest.raises(TypeError):
        p.instantiate()  # Outer.Inner takes no params: proves cls is the one called


@pytest.mark.parametrize("name, default, error", [
    ("x", 2, "already defined"),
    ("set", 1, "reserved"),
    ("copy", 1, "reserved"),
    ("cls", 1, "reserved"),
    ("_private", 1, "bad param name"),
    ("class", 1, "bad param name"),
    ("a.b", 1, "bad param name"),
    ("1a", 1, "bad param name"),
])
def test_define_errors(name, default, error):
    p = Params()
    p.define("x", 1, "x")
    with pytest.raises(ParamsError, match=error):
        p.define(name, default, "doc")
    assert p.x == 1


def test_instantiable_params_reserves_instantiate_and_cls():
    p = InstantiableParams(Builder)
    for name in ("cls", "instantiate"):
        with pytest.raises(ParamsError):
            p.define(name, 1, "")
    plain = Params()
    plain.define("instantiate", 1, "")  # only reserved where it is a method


@pytest.mark.parametrize("key, text, expected", [
    ("train.lr", "0.1", 0.1),
    ("train.lr", "1", 1.0),
    ("train.lr", "-2e-3", -2e-3),
    ("train.steps", "100", 100),
    ("train.flag", "True", True),
    ("train.opt", "adam", "adam"),
    ("train.opt", "'x,y'", "x,y"),
    ("train.opt", "123", "123"),
    ("train.opt", "os.path", "os.path"),
    ("train.opt", "False", False),  # a word-or-bool field (batch_weight_gradients='auto' or True)
    ("train.opt", "'True'", "True"),
    ("train.dims", "[64, 64]", [64, 64]),
    ("train.dims", "(1,)", [1]),
    ("train.shape", "[2, 3]", (2, 3)),
    ("train.table", "{'a': 1}", {"a": 1}),
    ("train.anything", "[1, 'a']", [1, "a"]),
    ("train.anything", "hello", "hello"),
    ("train.anything", "tests.hyperparams.test_hyperparams.relu", relu),
    ("train.builder", "tests.hyperparams.test_hyperparams.Outer.Inner", Outer.Inner),
    ("train.act", "builtins.len", len),
])
def test_override_accepts_good_values(key, text, expected):
    p = _override_tree()
    assert p.override(key, text) is p
    value = p.get(key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("key, text, message", [
    ("train.lr", "abc", "train.lr: cannot set 'abc' (expected float, e.g. train.lr=0.001)"),
    ("train.lr", "True", "train.lr: cannot set 'True' (expected float, e.g. train.lr=0.001)"),
    ("train.steps", "1.5", "train.steps: cannot set '1.5' (expected int, e.g. train.steps=1)"),
    ("train.steps", "False", "train.steps: cannot set 'False' (expected int, e.g. train.steps=1)"),
    ("train.flag", "1", "train.flag: cannot set '1' (expected bool, e.g. train.flag=True)"),
    ("train.dims", "64", "train.dims: cannot set '64' (expected list, e.g. train.dims=[1, 2])"),
    ("train.table", "[1]", "train.table: cannot set '[1]' (expected dict, e.g. train.table={'key': 1})"),
    ("train.builder", "no_such_mod_q.X",
     "train.builder: cannot set 'no_such_mod_q.X' (expected class, e.g. train.builder=some.module.SomeClass)"),
    ("train.builder", "tests.hyperparams.test_hyperparams.relu",
     "train.builder: cannot set 'tests.hyperparams.test_hyperparams.relu' (expected class, e.g. "
     "train.builder=some.module.SomeClass)"),
])
def test_override_rejects_bad_values_with_one_line_message(key, text, message):
    p = _override_tree()
    before = p.copy()
    with pytest.raises(ParamsError) as info:
        p.override(key, text)
    assert str(info.value) == message and "\n" not in str(info.value)
    assert p == before


def test_override_errors_for_nested_params_and_unknown_keys():
    p = _override_tree()
    with pytest.raises(ParamsError, match=r"train: cannot set '3' \(it is a nested Params"):
        p.override("train", "3")
    with pytest.raises(UnknownParamError, match=r"unknown param 'train\.lrr'.*did you mean 'train\.lr'\?"):
        p.override("train.lrr", "0.1")


def _override_tree() -> Params:
    train = Params()
    train.define("lr", 0.001, "learning rate")
    train.define("steps", 10, "steps")
    train.define("flag", False, "a bool")
    train.define("opt", "sgd", "a str")
    train.define("dims", [32], "a list")
    train.define("shape", (1, 1), "a tuple")
    train.define("table", {}, "a dict")
    train.define("anything", None, "None accepts anything")
    train.define("builder", Builder, "a class")
    train.define("act", relu, "a function")
    p = Params()
    p.define("train", train, "training")
    return p


def test_parse_overrides_splits_on_top_level_commas_only():
    spec = " a.b=1, c.d=[1, 2],e='x,y' ,, f={'k': (1, 2)},g=\"q,\\\"r\",h=a=b, "
    assert parse_overrides(spec) == [("a.b", "1"), ("c.d", "[1, 2]"), ("e", "'x,y'"),
                                     ("f", "{'k': (1, 2)}"), ("g", '"q,\\"r"'), ("h", "a=b")]
    assert parse_overrides("") == []


def test_parse_overrides_then_override_end_to_end():
    p = _override_tree()
    for key, text in parse_overrides("train.lr=0.1,train.dims=[64, 64],train.opt=adam"):
        p.override(key, text)
    assert (p.train.lr, p.train.dims, p.train.opt) == (0.1, [64, 64], "adam")


@pytest.mark.parametrize("spec, entry", [("a=1,b", "'b'"), ("=3", "'=3'")])
def test_parse_overrides_requires_key_equals_value(spec, entry):
    with pytest.raises(ParamsError, match="KEY=VALUE") as info:
        parse_overrides(spec)
    assert entry in str(info.value)


def test_top_level_cls_must_be_code():
    with pytest.raises(ParamsError, match=r"line 2 \('cls : 3'\)"):
        Params.from_text("a : 1\ncls : 3")


class _Wide:
    """A class whose default Params hold two fields."""

    @classmethod
    def params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.define("width", 8, "a width")
        p.define("depth", 2, "a depth")
        return p


class _Narrow:
    """Another class with one field of its own."""

    @classmethod
    def params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.define("rate", 0.5, "a rate")
        return p


def test_setting_cls_gives_the_new_class_default_params_so_its_fields_can_follow():
    p = Params()
    p.define("layer", _Wide.params().set(width=64), "a layer")
    p.override("layer.cls", "tests.hyperparams.test_hyperparams._Narrow")
    assert p.layer == _Narrow.params()  # no 'width' or 'depth' left behind
    p.override("layer.rate", "0.25")
    assert p.layer.rate == 0.25
    # Setting the class it already has keeps the fields as set.
    p.override("layer.cls", "tests.hyperparams.test_hyperparams._Narrow")
    assert p.layer.rate == 0.25
    # A class without a params() classmethod only changes the class, as before.
    p.override("layer.cls", "tests.hyperparams.test_hyperparams.Builder")
    assert p.layer.cls is Builder and p.layer.rate == 0.25


def test_a_node_set_to_a_class_path_becomes_that_class_default_params():
    p = Params()
    p.define("layer", _Wide.params(), "a layer")
    p.override("layer", "tests.hyperparams.test_hyperparams._Narrow")
    assert p.layer == _Narrow.params()
    with pytest.raises(ParamsError, match=r"layer: cannot set 'narrow' \(it is a nested InstantiableParams of _Narrow; "
                                          r"give a class path"):
        p.override("layer", "narrow")  # _Narrow knows no short names (no named_params)
    with pytest.raises(ParamsError,
                       match=r"layer=tests.hyperparams.test_hyperparams.Builder: .*Builder has no params\(\)"):
        p.override("layer", "tests.hyperparams.test_hyperparams.Builder")
    frozen = p.copy().freeze()
    with pytest.raises(ParamsError, match="frozen"):
        frozen.override("layer", "tests.hyperparams.test_hyperparams._Wide")


class _Shape:
    """A base whose subclasses are known by short names, as schedules are."""

    @classmethod
    def named_params(cls, name) -> InstantiableParams:
        return {"square": _Square, "circle": _Circle}[name].params()


class _Square(_Shape):
    """A shape with two fields."""

    @classmethod
    def params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.define("side", 1, "a side")
        p.define("fill", "none", "a fill")
        return p


class _Circle(_Shape):
    """Another shape, with a field of its own."""

    @classmethod
    def params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.define("radius", 1.0, "a radius")
        return p


SQUARE, CIRCLE = (f"tests.hyperparams.test_hyperparams.{c.__name__}" for c in (_Square, _Circle))


def _square_as_set():
    """A tree whose `shape` an experiment made a 3-sided square, then an override filled red."""
    p = Params()
    p.define("shape", _Square.params().set(side=3), "a shape")
    p.override("shape.fill", "red")
    return p


@pytest.mark.parametrize("key, text", [("shape", SQUARE), ("shape.cls", SQUARE), ("shape", "square"),
                                       ("shape", "'square'")])
def test_naming_the_class_a_node_already_has_keeps_its_fields_in_every_form(key, text):
    p, notes = _square_as_set(), []
    p.override(key, text, notes)
    assert p.shape == _Square.params().set(side=3, fill="red") and notes == []


@pytest.mark.parametrize("key, text", [("shape", CIRCLE), ("shape.cls", CIRCLE), ("shape", "circle")])
def test_another_class_starts_from_its_defaults_and_one_note_names_the_fields_reset(key, text):
    p, notes = _square_as_set(), []
    p.override(key, text, notes)
    assert p.shape == _Circle.params()
    # Only what differed from _Square's defaults is named: the experiment's side and the override's fill.
    assert notes == [f"{key}={text} replaces _Square by _Circle at its defaults, so what was set on _Square is "
                     "reset: side=3, fill='red' (set _Circle's fields after the class in --params)"]
    # Switching away from a node still at its class's defaults resets nothing, so nothing more is said.
    p.override(key, SQUARE if "." in text else "square", notes)
    assert p.shape == _Square.params() and len(notes) == 1


class _Layer:
    """A class with default Params, one of them nested."""

    @classmethod
    def params(cls) -> InstantiableParams:
        p = InstantiableParams(cls)
        p.define("width", 8, "a width")
        inner = Params()
        inner.define("scale", 1.0, "a scale")
        p.define("init", inner, "init")
        return p


def test_is_class_default_reads_the_defaults_of_the_nearest_class_above_the_field():
    root = Params()
    root.define("layers", [_Layer.params(), _Layer.params().set(width=4)], "layers")
    root.define("plain", 3, "a field no class holds")
    assert root.is_class_default("layers[0].width") and not root.is_class_default("layers[1].width")
    assert root.layers[0].is_class_default("init.scale")  # the root's own class
    assert root.is_class_default("layers[1].init.scale") and root.is_class_default("layers[1].init")
    root.layers[1].init.scale = 2.0
    assert not root.is_class_default("layers[1].init.scale") and not root.is_class_default("layers[1].init")
    assert not root.is_class_default("plain")
    # An item of a list: its class's defaults hold no such item.
    assert not root.is_class_default("layers[1]")
    with pytest.raises(ParamsError, match="no 'layers\\[2\\]'"):
        root.is_class_default("layers[2]")


def test_override_sets_an_optional_field_back_to_none_only_where_its_class_default_is():
    from gpipe_tf.gpipe.pipeline import GPipe

    p = GPipe.params().set(balance=[2, 4], num_stages=2)
    p.override("balance", "None")  # GPipe's default balance is None: the command line can clear it again
    assert p.balance is None
    with pytest.raises(ParamsError, match=r"num_stages: cannot set 'None' \(expected int"):
        p.override("num_stages", "None")  # its default is 1: None is no value of it
    plain = _override_tree()  # no class gives defaults: a field holding a list takes lists only
    with pytest.raises(ParamsError, match=r"train.dims: cannot set 'None' \(expected list"):
        plain.override("train.dims", "None")
