"""Test set-up: 8 fake CPU devices, requested before JAX starts its backend."""

import os
import re

os.environ["XLA_FLAGS"] = (
    re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")) + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def pytest_collection_modifyitems(config, items):
    """Files with heavy (multi-process, long) tests first: with one file per worker
    (``-n 2 --dist loadfile``) the light files then fill in at the end, so neither
    worker is left alone with a long file while the other idles."""
    heavy_files = {item.path for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.path not in heavy_files)
