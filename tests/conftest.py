"""Every run in the test suite checks its emulated devices' memory op by op (``--check-memory``):
the tests hold measured peaks to their plans and count out-of-memory where it happens. A test that
runs without the check says so (``check_memory=False``)."""

import os

from harmony.runtime.device import CHECK_MEMORY_ENV

os.environ[CHECK_MEMORY_ENV] = "1"
