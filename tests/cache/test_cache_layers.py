"""kvserve.cache is two layers: bookkeeping (the pool, hashes, block tables, transfer orders: plain Python) and
the storage under it (kvserve.cache.storage: tensors, formats, tiers). Importing the bookkeeping must not
import torch, so the scheduler's side stays plain Python and `kvserve plan` / `kvserve advise` stay light."""

import subprocess
import sys
from pathlib import Path

import pytest

import kvserve.cache

CACHE_DIR = Path(kvserve.cache.__file__).parent


def bookkeeping_modules() -> list[str]:
    """kvserve.cache and every module directly in it (each new one is covered without editing this test)."""
    return ["kvserve.cache"] + sorted(f"kvserve.cache.{path.stem}" for path in CACHE_DIR.glob("*.py")
                                      if path.stem != "__init__")


def test_the_bookkeeping_modules_are_the_expected_ones():
    assert set(bookkeeping_modules()) >= {"kvserve.cache.block_hash", "kvserve.cache.block_pool",
                                          "kvserve.cache.kv_cache_manager", "kvserve.cache.transfers",
                                          "kvserve.cache.tier_stats"}
    assert (CACHE_DIR / "storage" / "kv_tiers.py").exists()


@pytest.mark.parametrize("module", bookkeeping_modules())
def test_bookkeeping_imports_no_torch(module):
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", f"importing {module} imports torch"


def test_the_storage_layer_is_where_torch_is():
    """The check above would pass vacuously if nothing imported torch in the fresh process: storage does."""
    probe = "import sys, kvserve.cache.storage.kv_tiers; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"
