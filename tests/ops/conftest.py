"""The ops tests reuse the end-to-end stack fixture."""

from tests.e2e.conftest import stack_factory  # noqa: F401 - a fixture
