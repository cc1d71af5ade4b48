"""pytest fixtures of the crash tests (test_crash_campaign.py, test_crash_faults.py): one warm
zygote per module, and each scenario prepared once per module (its template and clean run)."""

from __future__ import annotations

import pytest

from tests.crash_harness.scenarios import SCENARIOS, Prepared
from tests.support.zygote import ZygoteRunner


@pytest.fixture(scope="module")
def zygote():
    z = ZygoteRunner()
    yield z
    z.close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, zygote):
    cache: dict[str, Prepared] = {}
    root = tmp_path_factory.mktemp("crash")

    def get(name: str) -> Prepared:
        if name not in cache:
            cache[name] = Prepared(SCENARIOS[name], root / name, zygote)
        return cache[name]

    return get
