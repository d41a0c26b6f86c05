"""Server configuration read from files: API keys, tenants and their weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.server.app import load_api_keys


def test_keys_file_gives_tenants_and_weights(tmp_path: Path):
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nk1 alpha 3\nk2 alpha\nk3 beta 0.5  # half a share\nk4\n")
    keys, weights = load_api_keys(["k5"], f)
    assert keys["k1"] == keys["k2"] == "alpha" and keys["k3"] == "beta"
    assert keys["k4"].startswith("key-") and keys["k5"].startswith("key-")
    assert weights == {"alpha": 3.0, "beta": 0.5}


@pytest.mark.parametrize("line", ["k1 a 0", "k1 a -2", "k1 a x", "k1 a nan", "k1 a 1 2"])
def test_bad_key_lines_name_the_file_and_line(tmp_path: Path, line: str):
    f = tmp_path / "keys.txt"
    f.write_text(f"ok tenant\n{line}\n")
    with pytest.raises(EmberError, match=r"keys.txt:2"):
        load_api_keys([], f)
