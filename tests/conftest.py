"""Test set-up: 8 simulated CPU devices, before JAX initializes any backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)   # before pytest's own hook deselects by marker (-m)
def pytest_collection_modifyitems(config, items):
  """Marks slow the cases that a test class names in SLOW_CASES, as "test_name" or
  "test_name[id]": a backend's longest duplicates of cases that the default run has on
  other backends (tests/contract/test_pallas_tpu.py)."""
  del config
  for item in items:
    names = getattr(getattr(item, "cls", None), "SLOW_CASES", ())
    if item.name in names or getattr(item, "originalname", None) in names:
      item.add_marker(pytest.mark.slow)
