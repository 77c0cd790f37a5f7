"""Image inputs: the real TFDS builders (CIFAR-10/100, ImageNet 2012) prepared offline from tiny fake files,
the input pipeline on top of them, and the generated grating images."""


import numpy as np
import pytest
import tensorflow as tf

from gpipe_tf.errors import ConfigError
from gpipe_tf.hyperparams import ParamsError
from gpipe_tf.inputs import tfds_images
from gpipe_tf.inputs.generated_images import GeneratedImageInput
from gpipe_tf.inputs.tfds_images import DatasetNotPreparedError, TfdsImageInput
from tests.helpers import fake_tfds, guards

IMAGENET_SYNSETS = fake_tfds.imagenet_label_names()[:3]


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    """A data_dir with fake cifar10 (5 x 8 train, 12 test) and cifar100 (8 train, 12 test), and what was written."""
    root = tmp_path_factory.mktemp("cifar")
    data_dir = str(root / "data")
    written = {name: fake_tfds.prepare_cifar(name, data_dir, str(root / name), seed=i)
               for i, name in enumerate(["cifar10", "cifar100"])}
    return data_dir, written


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """A data_dir with fake imagenet2012 (3 synsets x 6 train images, 10 validation images)."""
    root = tmp_path_factory.mktemp("imagenet")
    data_dir = str(root / "data")
    written = fake_tfds.prepare_imagenet(data_dir, str(root / "manual"), IMAGENET_SYNSETS)
    return data_dir, written


def _cifar_input(data_dir, **kwargs):
    return TfdsImageInput.params().set(dataset="cifar10", data_dir=data_dir, shuffle_buffer=64, **kwargs).instantiate()


def _batches(inp, count=None):
    ds = inp.dataset() if count is None else inp.dataset().take(count)
    return [{k: v.numpy() for k, v in b.items()} for b in ds]


def _to_pixels(inputs, dataset):
    """Undo the per-channel normalization: back to uint8 pixels (pad pixels come back as 0)."""
    spec = tfds_images._DATASETS[dataset]
    return np.round((inputs * np.array(spec.std) + np.array(spec.mean)) * 255.0).astype(np.int64)


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in ("inputs", "labels")) and len(a) == len(b)


def test_helpers_and_bad_params(cifar):
    assert [tfds_images.num_classes(d) for d in ("cifar10", "cifar100", "imagenet2012")] == [10, 100, 1000]
    assert [tfds_images.default_image_size(d) for d in ("cifar10", "imagenet2012")] == [32, 224]
    with pytest.raises(ParamsError, match="choose from"):
        tfds_images.num_classes("mnist")
    with pytest.raises(ConfigError, match="Unknown split 'dev'"):
        _cifar_input(cifar[0], split="dev")
    with pytest.raises(ConfigError, match="fewer than batch_size=16"):
        _cifar_input(cifar[0], split="test", batch_size=16)
    with pytest.raises(ParamsError, match="manual_dir is only used by imagenet2012"):
        _cifar_input(cifar[0], manual_dir="/nowhere")


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_cifar_eval_gives_the_written_images_and_labels(cifar, dataset):
    data_dir, written = cifar
    inp = TfdsImageInput.params().set(dataset=dataset, split="test", data_dir=data_dir, training=False,
                                      batch_size=4, num_batches=3).instantiate()
    ds = inp.dataset()
    assert ds.element_spec["inputs"].shape.as_list() == [4, 32, 32, 3]  # static batch dimension
    assert ds.element_spec["inputs"].dtype == tf.float32 and ds.element_spec["labels"].dtype == tf.int32
    batches = _batches(inp)
    assert len(batches) == 3
    labels, images = written[dataset]["test"]
    expected = {images[i].tobytes(): int(labels[i]) for i in range(len(labels))}
    got = {}
    for b in batches:
        for image, label in zip(_to_pixels(b["inputs"], dataset).astype(np.uint8), b["labels"]):
            got[image.tobytes()] = int(label)
    assert got == expected  # every test image exactly once, unaugmented, with its own label


def test_cifar_eval_is_deterministic_and_finite(cifar):
    data_dir, _ = cifar
    make = lambda n: _cifar_input(data_dir, split="test", training=False, batch_size=4, num_batches=n)  # noqa: E731
    inp = make(2)
    first = _batches(inp)
    assert len(first) == 2 and _same(first, _batches(inp)) and _same(first, _batches(make(2)))
    assert len(_batches(make(10))) == 3  # one pass: 12 examples hold only 3 full batches of 4


def test_cifar_training_is_pad_crop_flip_of_the_right_image(cifar):
    data_dir, written = cifar
    labels, images = written["cifar10"]["train"]
    inp = _cifar_input(data_dir, batch_size=8, seed=3)
    assert inp.dataset().element_spec["inputs"].shape.as_list() == [8, 32, 32, 3]
    batches = _batches(inp, 10)  # two epochs of 40
    for epoch in (batches[:5], batches[5:]):
        assert sorted(np.concatenate([b["labels"] for b in epoch])) == sorted(labels)
    assert not np.array_equal(batches[0]["labels"], batches[5]["labels"])  # reshuffled each epoch

    padded = np.pad(images.astype(np.int64), [(0, 0), (4, 4), (4, 4), (0, 0)])
    shifts, flips = set(), set()
    for image, label in zip(_to_pixels(batches[0]["inputs"], "cifar10"), batches[0]["labels"]):
        matches = [(i, dy, dx, flip) for flip in (False, True) for dy in range(9) for dx in range(9)
                   for i in np.flatnonzero(labels == label)
                   if np.array_equal((padded[i, dy:dy + 32, dx:dx + 32, :][:, ::-1] if flip
                                      else padded[i, dy:dy + 32, dx:dx + 32]), image)]
        assert matches, "an augmented image is not a padded crop (maybe flipped) of a same-label image"
        shifts.add(matches[0][1:3])
        flips.add(matches[0][3])
    assert len(shifts) > 1 and flips == {False, True}


def test_cifar_training_randomness_follows_the_seed(cifar):
    data_dir, _ = cifar
    first = _batches(_cifar_input(data_dir, batch_size=8, seed=3), 2)
    assert _same(first, _batches(_cifar_input(data_dir, batch_size=8, seed=3), 2))
    other = _batches(_cifar_input(data_dir, batch_size=8, seed=4), 2)
    assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])
    finite = _batches(_cifar_input(data_dir, batch_size=8, seed=3, num_batches=7))
    assert len(finite) == 7 and _same(finite[:2], first)  # a finite training input repeats the split


def test_cifar_iterator_checkpoint_resumes_exactly(cifar, tmp_path):
    data_dir, _ = cifar
    iterator = iter(_cifar_input(data_dir, batch_size=8, seed=5).dataset())
    next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / "ckpt"))
    expected = [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(6)]  # crosses an epoch
    resumed = iter(_cifar_input(data_dir, batch_size=8, seed=5).dataset())
    tf.train.Checkpoint(iterator=resumed).read(path).assert_consumed()
    assert _same(expected, [{k: v.numpy() for k, v in next(resumed).items()} for _ in range(6)])


def test_cifar_split_slices_and_resizing(cifar):
    data_dir, written = cifar
    inp = _cifar_input(data_dir, split="train[:50%]", image_size=40, batch_size=4, num_batches=2)
    assert inp.num_examples == 20
    assert inp.dataset().element_spec["inputs"].shape.as_list() == [4, 40, 40, 3]
    evaluation = TfdsImageInput.params().set(dataset="cifar100", split="train[50%:]", data_dir=data_dir,
                                             training=False, image_size=24, dtype="float64", batch_size=4)
    batch = _batches(evaluation.instantiate(), 1)[0]
    assert batch["inputs"].shape == (4, 24, 24, 3) and batch["inputs"].dtype == np.float64
    assert set(batch["labels"]) <= set(written["cifar100"]["train"][0].tolist())


def test_imagenet_training_and_eval(imagenet):
    data_dir, written = imagenet
    make = lambda **kw: TfdsImageInput.params().set(  # noqa: E731
        dataset="imagenet2012", data_dir=data_dir, image_size=64, **kw).instantiate()
    train = make(split="train", batch_size=6, seed=1)
    ds = train.dataset()
    assert ds.element_spec["inputs"].shape.as_list() == [6, 64, 64, 3]
    batches = _batches(train, 3)  # one epoch of 18
    labels = np.concatenate([b["labels"] for b in batches])
    assert sorted(labels) == sorted(written["train"].values())
    assert all(np.isfinite(b["inputs"]).all() and np.abs(b["inputs"]).max() < 3.0 for b in batches)
    assert _same(batches[:1], _batches(make(split="train", batch_size=6, seed=1), 1))
    assert not np.array_equal(batches[0]["inputs"], _batches(make(split="train", batch_size=6, seed=2), 1)[0]["inputs"])

    evaluation = make(split="validation", training=False, batch_size=5, num_batches=2)
    eval_batches = _batches(evaluation)
    assert len(eval_batches) == 2 and _same(eval_batches, _batches(evaluation))
    assert sorted(np.concatenate([b["labels"] for b in eval_batches])) == sorted(written["validation"].values())


def test_imagenet_eval_takes_the_central_crop(imagenet):
    # A blue square exactly where the 0.875 central crop of a 100 x 80 photo falls, framed in red.
    pixels = np.zeros((100, 80, 3), np.uint8)
    pixels[..., 0] = 255
    pixels[15:85, 5:75] = [0, 0, 255]
    jpeg = tf.io.encode_jpeg(pixels, quality=100)
    inp = TfdsImageInput.params().set(dataset="imagenet2012", data_dir=imagenet[0], split="validation",
                                      training=False, image_size=64, batch_size=2).instantiate()
    seeds = tf.zeros([2, 2], tf.int64)
    image = inp._imagenet(jpeg, seeds).numpy()
    assert image.shape == (64, 64, 3)
    assert image[..., 2].mean() > 240 and image[2:-2, 2:-2, 0].max() < 40, image[..., 0].max()
    training = TfdsImageInput.params().set(dataset="imagenet2012", data_dir=imagenet[0], image_size=64,
                                           batch_size=2).instantiate()
    red_share = [training._imagenet(jpeg, tf.constant([[s, 0], [s, 1]], tf.int64)).numpy()[..., 0].mean()
                 for s in range(8)]
    assert max(red_share) - min(red_share) > 20  # random-resized crops land on different parts


def test_imagenet_prepares_from_manual_dir(tmp_path):
    written = fake_tfds.write_imagenet_manual_dir(str(tmp_path / "manual"), IMAGENET_SYNSETS[:1], 2, 4)
    inp = TfdsImageInput.params().set(dataset="imagenet2012", split="validation", data_dir=str(tmp_path / "data"),
                                      manual_dir=str(tmp_path / "manual"), image_size=32, training=False,
                                      batch_size=4, num_batches=1).instantiate()
    assert sorted(_batches(inp)[0]["labels"]) == sorted(written["validation"].values())


def test_missing_dataset_fails_fast_with_a_fix(tmp_path, monkeypatch):
    guards.forbid_downloads(monkeypatch)
    with pytest.raises(DatasetNotPreparedError) as info:
        _cifar_input(str(tmp_path))
    message = str(info.value)
    assert "'cifar10'" in message and str(tmp_path) in message and "tfds build cifar10" in message
    with pytest.raises(DatasetNotPreparedError, match="manual_dir=DIR"):
        TfdsImageInput.params().set(dataset="imagenet2012", data_dir=str(tmp_path)).instantiate()
    with pytest.raises(DatasetNotPreparedError, match="holds none of"):
        TfdsImageInput.params().set(dataset="imagenet2012", data_dir=str(tmp_path),
                                    manual_dir=str(tmp_path)).instantiate()
    assert isinstance(info.value, ConfigError)


def _generated(**kwargs):
    return GeneratedImageInput.params().set(**kwargs).instantiate()


def test_generated_images_shapes_and_determinism():
    inp = _generated(seed=1, batch_size=8, num_batches=3)
    ds = inp.dataset()
    assert ds.element_spec["inputs"].shape.as_list() == [8, 32, 32, 3]
    assert ds.element_spec["labels"].dtype == tf.int32
    batches = _batches(inp)
    assert len(batches) == 3 and _same(batches, _batches(_generated(seed=1, batch_size=8, num_batches=3)))
    assert all(((b["labels"] >= 0) & (b["labels"] < 10)).all() for b in batches)
    # Examples depend on (seed, index) only, not on how they are batched.
    halves = _batches(_generated(seed=1, batch_size=4, num_batches=2))
    assert np.array_equal(np.concatenate([h["inputs"] for h in halves]), batches[0]["inputs"])
    assert not np.array_equal(_batches(_generated(seed=2, batch_size=8, num_batches=1))[0]["inputs"],
                              batches[0]["inputs"])
    endless = _batches(_generated(seed=1, batch_size=8), 4)
    assert _same(endless[:3], batches)
    small = _batches(_generated(num_classes=3, image_size=16, dtype="float64", batch_size=2), 1)[0]
    assert small["inputs"].shape == (2, 16, 16, 3) and small["inputs"].dtype == np.float64
    with pytest.raises(ParamsError):
        _generated(num_classes=1)


def test_generated_classes_need_a_nonlinear_feature():
    """Phase-invariant spectra separate the classes; raw pixels (every class mean is ~flat) barely do."""
    def split(seed):
        batch = _batches(_generated(seed=seed, batch_size=400, num_batches=1))[0]
        return batch["inputs"], batch["labels"]

    (x_train, y_train), (x_test, y_test) = split(1), split(2)
    assert np.bincount(y_train, minlength=10).min() > 20

    def nearest_class_mean_accuracy(features):
        f_train, f_test = features(x_train), features(x_test)
        means = np.stack([f_train[y_train == c].mean(0) for c in range(10)])
        predicted = np.argmin(((f_test[:, None] - means[None]) ** 2).sum(-1), axis=1)
        return (predicted == y_test).mean()

    spectral = nearest_class_mean_accuracy(
        lambda x: np.log1p(np.abs(np.fft.fft2(x, axes=(1, 2)))).reshape(len(x), -1))
    raw = nearest_class_mean_accuracy(lambda x: x.reshape(len(x), -1))
    assert spectral > 0.8 and raw < 0.5, (spectral, raw)
