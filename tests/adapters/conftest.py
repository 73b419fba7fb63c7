"""Fixtures the adapter tests share."""

import pytest


@pytest.fixture
def x64():
    """float64 in JAX for the duration of one test."""
    jax = pytest.importorskip("jax")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
