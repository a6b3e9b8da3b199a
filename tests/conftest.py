"""Two tiers. Tests that start processes (a gloo world, or the meshkd command) are marked `world` and run
after the single-process ones, which alone take seconds: `python -m pytest -m "not world"`."""

import os
import shutil
import subprocess
import tempfile

import pytest

# One compute thread per process unless the caller says otherwise, set before torch is imported here or in any
# process the tests start (they inherit it): the tiny models gain nothing from intra-op threads, and the
# processes of a world already share the cores, where a second thread per process mostly waits for the first
# (a one-process precision world measured 65 CPU-s with two threads on 2 busy cores, 16 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Token stores (every run's rows: `meshkd.recipe.corpus.corpus_store`) go to meshkd's cache directory unless a config
# names one: the tests' go to a directory of this test session, shared by the processes it starts, removed after.
os.environ["MESHKD_CACHE"] = tempfile.mkdtemp(prefix="meshkd-tests-")


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["MESHKD_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("world") is not None)  # stable: file order kept


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs mounted under `tmp_path`: a real disk that fills up (needs root, else skipped)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
