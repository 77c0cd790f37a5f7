"""Packaging for gpipe_tf: the library, the model registry, the experiment params and trainer.py."""

from setuptools import find_packages, setup

setup(
    name="gpipe_tf",
    version="0.1.0",
    description="Lingvo-style TensorFlow 2 trainer with GPipe pipeline parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Only the gpipe_tf namespace is installed, so that no top-level `params`, `model_registry` or `trainer` collides
    # with a user's own modules: the checkout's params/ and model_registry/ folders are installed as
    # gpipe_tf.params and gpipe_tf.model_registry, and trainer.py is a launcher for gpipe_tf.trainer_main.
    packages=(find_packages(include=["gpipe_tf", "gpipe_tf.*"])
              + ["gpipe_tf.model_registry"]
              + ["gpipe_tf." + name for name in find_packages(include=["params", "params.*"])]),
    package_dir={"gpipe_tf.model_registry": "model_registry", "gpipe_tf.params": "params"},
    install_requires=[
        "tensorflow>=2.21,<2.22",
        # TF 2.21 no longer pulls TensorBoard in, and tf.summary raises without it.
        "tensorboard>=2.21,<2.22",
        "tensorflow-datasets>=4.9,<5",
        # TFDS 4.9 imports importlib_resources without declaring it on Python >= 3.9.
        "importlib_resources>=5",
        "absl-py>=2.0,<3",
        "gin-config>=0.5,<0.6",
        # Offline translation data (numbers spelled out in many languages) and its subword vocabulary.
        "num2words>=0.5.14,<0.6",
        "sentencepiece>=0.2,<0.3",
        # Corpus BLEU for --mode=decode: the standard, comparable implementation.
        "sacrebleu>=2.3,<3",
        # The timeline picture's title, axis and legend text (its built-in scalable font needs Pillow >= 10.1);
        # TensorBoard already depends on Pillow.
        "pillow>=10.1",
        "numpy>=1.26",
    ],
    extras_require={
        # pytest-xdist runs the suite in two worker processes (docs/contributing.md#the-test-command).
        "test": ["pytest>=8", "pytest-xdist>=3.5,<4"],
        # Pinned exactly: a newer ruff adds rules and changes fixes, so an unchanged checkout could start failing
        # `ruff check .` in CI (docs/contributing.md#the-linter).
        "lint": ["ruff==0.17.6"],
        # TensorBoard's Profile tab for --profile_steps traces; large, so optional.
        "profile": ["tensorboard-plugin-profile>=2.15"],
    },
    entry_points={"console_scripts": ["gpipe-trainer=gpipe_tf.trainer_main:run"]},
)
