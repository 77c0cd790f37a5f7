"""The wheel installs the gpipe_tf namespace alone: no top-level `params`, `model_registry` or `trainer` module
that could shadow a user's own, and the console script points into it."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

from tests.helpers.paths import ROOT


def test_the_wheel_holds_only_the_gpipe_tf_namespace(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info/ next to the sources.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "gpipe_tf", "params", "model_registry"):
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        copy(os.path.join(ROOT, name), source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path), str(source)], capture_output=True, text=True,
                           timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "gpipe_tf-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"gpipe_tf", "gpipe_tf-0.1.0.dist-info"}, sorted(names)[:20]
    assert {"gpipe_tf/params/toy/classifier.py", "gpipe_tf/model_registry/__init__.py",
            "gpipe_tf/trainer_main.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read("gpipe_tf-0.1.0.dist-info/entry_points.txt").decode()
    assert "gpipe-trainer = gpipe_tf.trainer_main:run" in entry_points, entry_points
