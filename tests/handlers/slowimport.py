"""A handler module that takes a second to import: a reload that imports it is still under way
when the test sends its next signal (tests/integration/test_pools_crossing.py)."""

import time

from testhandlers import record as handle  # noqa: F401 (the handler, under another module's name)

time.sleep(1.0)
