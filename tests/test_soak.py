"""The randomized soak's short run: offloaded optimizers and parameters against plain
torch, and the object API against a dict of the expected bytes (tests/soak.py)."""

import pytest

import soak


@pytest.mark.parametrize("kind,seeds", [("optimizer", range(0, 8)), ("params", range(0, 40)), ("api", range(0, 6)),
                                        ("api-concurrent", range(0, 6))])
def test_soak_short(kind, seeds, tmp_path):
    assert soak.run(kind, seeds, str(tmp_path), verbose=False) == len(seeds)
