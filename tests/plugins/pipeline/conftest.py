"""The leak check of the end-to-end tests, for the worker-death tests here."""

from tests.e2e.conftest import no_leaks  # noqa: F401
