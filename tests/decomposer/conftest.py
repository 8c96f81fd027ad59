"""The decomposer tests run quiet: tracing warns about what it cannot see, by design."""

import warnings

import pytest


@pytest.fixture(autouse=True)
def _quiet_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
