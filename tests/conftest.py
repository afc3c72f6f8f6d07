"""Shared test helpers: where the real, read-only data files live (never copied into the repo)."""

import sys
from pathlib import Path

import pytest

# Let `pytest` run from a plain checkout (the package need not be installed).
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# /work/shared/data here; in CI the clone has shared/ beside it, so resolve from this file.
SHARED_DATA = _REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    # A missing data folder is a broken checkout, not a reason to skip: fail loudly.
    assert SHARED_DATA.is_dir(), f"shared data not found at {SHARED_DATA}"
    return SHARED_DATA
