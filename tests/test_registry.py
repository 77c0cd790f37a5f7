"""Model registry: keys from module paths, lazy look-up, listing, errors."""

import sys

import pytest

import model_registry


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(model_registry, "_REGISTRY", dict(model_registry._REGISTRY))
    return model_registry


def test_get_imports_the_module_lazily():
    sys.modules.pop("params.toy.classifier", None)
    model_registry._REGISTRY.pop("toy.classifier.BlobsMlp", None)
    cls = model_registry.get("toy.classifier.BlobsMlp")
    assert cls.__name__ == "BlobsMlp" and cls.registry_key == "toy.classifier.BlobsMlp"
    assert "params.toy.classifier" in sys.modules


def test_list_models_finds_every_experiment():
    assert "toy.classifier.BlobsMlp" in model_registry.list_models()


def test_unknown_key_suggests_close_keys():
    with pytest.raises(model_registry.RegistryError, match=r"unknown model 'toy.classifier.BlobMlp'; "
                                                           r"did you mean 'toy.classifier.BlobsMlp'"):
        model_registry.get("toy.classifier.BlobMlp")
    with pytest.raises(model_registry.RegistryError, match="--list_models"):
        model_registry.get("nothing.like.this")


def test_key_comes_from_the_module_under_params(registry):
    cls = type("Foo", (), {"__module__": "params.area.mod"})
    assert registry.register(cls) is cls
    assert registry.get("area.mod.Foo") is cls


def test_class_outside_params_needs_an_explicit_key(registry):
    cls = type("Foo", (), {"__module__": "somewhere.else"})
    with pytest.raises(model_registry.RegistryError, match="params/<area>/<module>.py"):
        registry.register(cls)
    registry.register(key="x.y.Foo")(cls)
    assert registry.get("x.y.Foo") is cls


def test_duplicate_key_is_an_error(registry):
    registry.register(key="x.y.Dup")(type("A", (), {}))
    with pytest.raises(model_registry.RegistryError, match="duplicate model key 'x.y.Dup'"):
        registry.register(key="x.y.Dup")(type("B", (), {}))
