"""Test set-up: 8 simulated CPU devices, before JAX initializes any backend.

XLA's CPU code generation runs at LLVM optimization level 0 unless XLA_FLAGS says otherwise:
the suite compiles many small programs once each and runs them on tiny arrays, so compiling
is most of its time; level 0 took about 40% off the contract files (tests/contract/
test_xla.py 172 s -> 97 s, 34 cases of test_pallas_tpu.py 143 s -> 81 s, on two cores). The
checks and tolerances are the same. The TPU program compiled without a TPU that was compared
(tests/test_tpu_compile.py, v5p:2x2x2, causal) is the same text with and without it. The
processes the tests start inherit it, except those started without XLA_FLAGS (training and
generation runs); `bash scripts/demo` and scripts/random_check.py keep XLA's default.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()

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
