"""Fixtures every test module can use without importing them."""

from tests.daemon import daemon_fixture  # noqa: F401  (registers the `daemon` fixture)
