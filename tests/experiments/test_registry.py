"""Model registry: keys from module paths, lazy look-up, listing, errors."""

import importlib
import re
import sys

import pytest

from gpipe_tf import model_registry


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(model_registry, "_REGISTRY", dict(model_registry._REGISTRY))
    return model_registry


def test_get_imports_the_module_lazily():
    sys.modules.pop("gpipe_tf.params.toy.classifier", None)
    model_registry._REGISTRY.pop("toy.classifier.BlobsMlp", None)
    cls = model_registry.get("toy.classifier.BlobsMlp")
    assert cls.__name__ == "BlobsMlp" and cls.registry_key == "toy.classifier.BlobsMlp"
    assert "gpipe_tf.params.toy.classifier" in sys.modules


def test_list_models_finds_every_experiment():
    assert "toy.classifier.BlobsMlp" in model_registry.list_models()


def test_unknown_key_suggests_close_keys():
    with pytest.raises(model_registry.RegistryError, match=r"unknown model 'toy.classifier.BlobMlp'; "
                                                           r"did you mean 'toy.classifier.BlobsMlp'"):
        model_registry.get("toy.classifier.BlobMlp")
    with pytest.raises(model_registry.RegistryError, match="--list_models"):
        model_registry.get("nothing.like.this")


def test_key_comes_from_the_module_under_params(registry):
    cls = type("Foo", (), {"__module__": "gpipe_tf.params.area.mod"})
    assert registry.register(cls) is cls
    assert registry.get("area.mod.Foo") is cls


def test_a_module_too_deep_under_params_needs_an_explicit_key(registry):
    cls = type("Foo", (), {"__module__": "gpipe_tf.params.area.sub.mod"})
    with pytest.raises(model_registry.RegistryError, match="params/<area>/<module>.py"):
        registry.register(cls)
    registry.register(key="x.y.Foo")(cls)
    assert registry.get("x.y.Foo") is cls


def test_class_outside_params_is_keyed_by_its_module_path(registry):
    cls = type("Foo", (), {"__module__": "somewhere.else"})
    registry.register(cls)
    assert cls.registry_key == "somewhere.else.Foo" and registry.get("somewhere.else.Foo") is cls
    with pytest.raises(model_registry.RegistryError, match="top level of an importable module"):
        registry.register(type("Bar", (), {"__module__": "__main__"}))


def test_a_user_package_registers_without_editing_the_checkout(registry, tmp_path, monkeypatch):
    package = tmp_path / "userpkg"
    (package / "experiments").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "experiments" / "__init__.py").write_text("")
    (package / "experiments" / "mine.py").write_text(
        "from gpipe_tf import model_registry\n"
        "from gpipe_tf.params.toy.classifier import BlobsMlp\n\n\n"
        "@model_registry.register\n"
        "class Wider(BlobsMlp):\n"
        "    \"\"\"A wider MLP.\"\"\"\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(registry, "_USER_MODULES", [])
    # The key names the module: get() imports it, nothing to declare first.
    assert registry.get("userpkg.experiments.mine.Wider").__name__ == "Wider"
    # --module imports a package's modules so that listing shows them beside the built-in ones.
    registry._REGISTRY.pop("userpkg.experiments.mine.Wider")
    for name in [m for m in sys.modules if m.startswith("userpkg")]:
        monkeypatch.delitem(sys.modules, name)
    registry.import_modules(["userpkg.experiments"])
    listed = registry.list_models()
    assert "userpkg.experiments.mine.Wider" in listed and "toy.classifier.BlobsMlp" in listed


def test_a_missing_user_module_names_itself(registry, monkeypatch):
    monkeypatch.setattr(registry, "_USER_MODULES", [])
    with pytest.raises(model_registry.RegistryError, match="cannot import experiment module 'no_such_pkg.exps'"):
        registry.import_modules(["no_such_pkg.exps"])


def test_duplicate_key_is_an_error(registry):
    registry.register(key="x.y.Dup")(type("A", (), {}))
    with pytest.raises(model_registry.RegistryError, match="duplicate model key 'x.y.Dup'"):
        registry.register(key="x.y.Dup")(type("B", (), {}))



def _write_module(directory, name, *hidden_dims):
    """A user module defining one experiment class named Wide per entry of `hidden_dims`."""
    text = "from gpipe_tf import model_registry\nfrom gpipe_tf.params.toy.classifier import BlobsMlp\n"
    for dims in hidden_dims:
        text += f"\n\n@model_registry.register\nclass Wide(BlobsMlp):\n    hidden_dims = {dims!r}\n"
    (directory / f"{name}.py").write_text(text)


def test_two_experiments_of_one_name_in_one_module_are_an_error_naming_both(registry, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_module(tmp_path, "twice_named", (128,), (256,))
    monkeypatch.delitem(sys.modules, "twice_named", raising=False)
    with pytest.raises(model_registry.RegistryError) as info:
        registry.get("twice_named.Wide")
    # The lines of the two definitions (their decorator's line, or their class line on some Python versions).
    assert re.fullmatch(r"module twice_named defines two experiment classes named Wide \(lines [56] and 1[01]\), both "
                        r"registered as 'twice_named.Wide', so the second would replace the first; rename one of them",
                        str(info.value)), str(info.value)
    # A module imported again (its class defined once) registers its class anew: no error.
    _write_module(tmp_path, "imported_twice", (128,))
    first = registry.get("imported_twice.Wide")
    monkeypatch.delitem(sys.modules, "imported_twice")
    second = importlib.import_module("imported_twice").Wide
    assert second is not first and registry.get("imported_twice.Wide") is second
    monkeypatch.delitem(sys.modules, "imported_twice")


def test_a_module_that_raises_at_import_is_one_error_naming_it_and_its_line(registry, tmp_path, monkeypatch):
    # issue 35 item 6: the error names the module, the exception and the line of the user's package that raised.
    package = tmp_path / "raisingpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text("RATE = 1\n\n\ndef scale():\n    return RATE / 0\n\n\nFACTOR = scale()\n")
    (tmp_path / "unclosed.py").write_text("import os\n\nX = (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_USER_MODULES", [])
    mine = package / "mine.py"
    expected = (f"experiment module 'raisingpkg.mine' failed to import: ZeroDivisionError: division by zero (at "
                f"{mine}:5); fix the module there, or run the trainer with --traceback to see Python's traceback")
    try:
        with pytest.raises(registry.RegistryError) as raised:
            registry.import_modules(["raisingpkg.mine"])
        assert str(raised.value) == expected
        assert isinstance(raised.value.__cause__, ZeroDivisionError)  # the traceback --traceback prints
        for call in (lambda: registry.import_modules(["raisingpkg"]),  # a package: each module below it is imported
                     lambda: registry.get("raisingpkg.mine.Wider")):  # the key's module is imported the same way
            with pytest.raises(registry.RegistryError) as raised:
                call()
            assert str(raised.value) == expected
        with pytest.raises(registry.RegistryError,
                           match=rf"'unclosed' failed to import: SyntaxError: .*\(at {tmp_path / 'unclosed.py'}:3\)"):
            registry.import_modules(["unclosed"])
        assert registry._USER_MODULES == []
    finally:
        for name in [m for m in sys.modules if m.partition(".")[0] == "raisingpkg"]:
            del sys.modules[name]
