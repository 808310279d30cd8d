"""What a test does when a real service it needs (llama-server, PostgreSQL) is missing.

Under ``CI=true`` the service is an install step of ``.ci/run``, so its absence
is a failure, never a silent skip. On a developer machine without it, the
test skips with the reason and the command that provides it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def service_missing(reason: str, *, fix: str = "") -> NoReturn:
    """Fail under ``CI=true``, skip elsewhere; ``fix`` says how to get the service."""
    hint = f"; {fix}" if fix else ""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}{hint}", pytrace=False)
    pytest.skip(f"{reason}{hint}")
