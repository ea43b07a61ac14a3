"""Test set-up: 8 simulated CPU devices, before JAX initializes any backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
