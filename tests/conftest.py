"""Shared test set-up: every test gets its own resfuse cache directory."""
import pytest


@pytest.fixture(autouse=True)
def _resfuse_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RESFUSE_CACHE_DIR", str(tmp_path / "resfuse-cache"))
