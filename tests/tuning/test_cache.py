"""The tuning cache's semantics: key fields, concurrency, corruption, export/import, force-retune."""
import dataclasses
import multiprocessing as mp
import sqlite3
import warnings

import pytest
import torch

from resfuse.tuning.cache import Entry, Key, TuningCache, machine

KEY = Key("conv2d", (32, 64, 56, 56, 256, 1, 1, (1, 1), (0, 0), (1, 1)), ("float16", "float16"),
          ((200704, 1, 3584, 64), (64, 1, 64, 64)), "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))",
          "NVIDIA H100 80GB HBM3", 132, (("torch", "2.11"), ("triton", "3.6"), ("cuda", "13.0"),
                                         ("cudnn", "91000"), ("template", "1")))
ENTRY = Entry("triton", {"block_m": 128, "block_n": 128, "split_k": 1}, {"triton-128x128": 4.1e-5, "aten": 8.2e-5})


@pytest.fixture
def cache(tmp_path):
    return TuningCache(tmp_path / "tuning.sqlite")


def test_hit_and_every_changed_key_field_is_a_miss(cache):
    assert cache.put(KEY, ENTRY)
    assert cache.get(KEY) == ENTRY
    changes = {"op": "gemm", "shape": (1,), "dtypes": ("bfloat16", "bfloat16"), "strides": ((1,), (1,)),
               "epilogue": "relu(acc)", "gpu": "NVIDIA H200", "sms": 114,
               "versions": KEY.versions[:-1] + (("template", "2"),)}
    assert set(changes) == {f.name for f in dataclasses.fields(Key)}
    for field, value in changes.items():
        assert cache.get(dataclasses.replace(KEY, **{field: value})) is None, field


def test_force_retune_replaces_and_plain_put_keeps(cache):
    cache.put(KEY, ENTRY)
    newer = Entry("cudnn", {"engine": 3}, {"cudnn": 3.0e-5})
    assert not cache.put(KEY, newer)
    assert cache.get(KEY) == ENTRY
    assert cache.put(KEY, newer, replace=True)
    assert cache.get(KEY) == newer and len(cache.entries()) == 1


def test_a_put_that_fails_midway_writes_nothing_and_holds_no_lock(cache):
    """put's BEGIN IMMEDIATE is rolled back by the connection's context manager when the write fails (a config that
    JSON cannot encode): no row, and the next writer does not wait on a lock."""
    bad = Entry("triton", {"block_m": object()}, {})
    with pytest.raises(TypeError) as failed:  # its traceback keeps put's connection open
        cache.put(KEY, bad)
    cache.timeout_s = 0.1  # a transaction left open on that connection would make this put wait, then fail
    assert cache.get(KEY) is None and cache.put(KEY, ENTRY) and cache.get(KEY) == ENTRY
    assert failed.value is not None


def checked(cache, key, machine):
    entry, was_checked = cache.lookup(key, machine)
    assert entry == cache.get(key)  # lookup reads the entry get reads, with its check, in one connection
    return was_checked


def test_a_check_is_kept_per_machine_until_its_choice_is_replaced(cache, tmp_path):
    """A choice checked on one machine (GPU and driver) is not checked again there; another machine, a replaced
    choice, a cleared cache or an import checks it again."""
    cache.put(KEY, ENTRY)
    assert not checked(cache, KEY, "gpu-a driver 1")
    cache.mark_checked(KEY, "gpu-a driver 1")
    assert checked(cache, KEY, "gpu-a driver 1")
    assert not checked(cache, KEY, "gpu-a driver 2") and not checked(cache, dataclasses.replace(KEY, op="gemm"),
                                                                             "gpu-a driver 1")
    assert not cache.put(KEY, ENTRY) and checked(cache, KEY, "gpu-a driver 1")  # a kept entry keeps its checks
    cache.export(tmp_path / "out.json")
    other = TuningCache(tmp_path / "other.sqlite")
    other.import_(tmp_path / "out.json")
    assert other.get(KEY) == ENTRY and not checked(other, KEY, "gpu-a driver 1")
    assert cache.put(KEY, Entry("cudnn", {"engine": 3}, {}), replace=True)
    assert not checked(cache, KEY, "gpu-a driver 1")
    cache.mark_checked(KEY, "gpu-a driver 1")
    cache.mark_checked(KEY, "gpu-a driver 2")
    assert cache.forget_checks() == 2  # as a cache carried elsewhere: the entry stays, its checks go
    assert cache.get(KEY) is not None and not checked(cache, KEY, "gpu-a driver 1")
    cache.mark_checked(KEY, "gpu-a driver 1")
    cache.clear()
    assert cache.lookup(KEY, "gpu-a driver 1") == (None, False)


def test_a_file_made_before_the_checks_table_gains_it(tmp_path):
    path = tmp_path / "tuning.sqlite"
    TuningCache(path).put(KEY, ENTRY)
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE checks")
    cache = TuningCache(path)
    assert cache.get(KEY) == ENTRY and not checked(cache, KEY, "m")
    cache.mark_checked(KEY, "m")
    assert checked(cache, KEY, "m")


def _writer(path, worker, n):
    c = TuningCache(path)
    for i in range(n):
        c.put(dataclasses.replace(KEY, sms=1000 * worker + i), Entry("aten", {}, {"aten": float(i + 1)}))


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "tuning.sqlite"
    TuningCache(path)
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(TuningCache(path).entries()) == 100


def test_corrupt_file_is_set_aside_and_rebuilt(tmp_path):
    path = tmp_path / "tuning.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.warns(UserWarning, match="unusable"):
        cache = TuningCache(path)
    assert cache.entries() == [] and cache.put(KEY, ENTRY) and cache.get(KEY) == ENTRY
    assert len(list(tmp_path.glob("tuning.sqlite.bad-*"))) == 1


def test_incompatible_schema_is_set_aside(tmp_path):
    path = tmp_path / "tuning.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE entries (x)")
        db.execute("PRAGMA user_version=99")
    with pytest.warns(UserWarning, match="schema version 99"):
        cache = TuningCache(path)
    assert cache.put(KEY, ENTRY)


def test_export_import_round_trip(cache, tmp_path):
    cache.put(KEY, ENTRY)
    cache.put(dataclasses.replace(KEY, op="gemm"), Entry("aten", {}, {"aten": 1e-5}))
    assert cache.export(tmp_path / "out.json") == 2
    other = TuningCache(tmp_path / "other.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert other.import_(tmp_path / "out.json") == 2
    assert other.get(KEY) == ENTRY
    assert cache.clear() == 2 and cache.entries() == []


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_a_gpus_machine_names_its_card_and_driver():
    """The check of a cached choice is kept per machine(device): a CUDA device gets its card's UUID and the
    driver's version, so a cache carried to another card or driver is checked there."""
    here = machine(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    assert here == machine(torch.device("cuda", 0)) != machine(torch.device("cpu")) == "cpu"
    assert str(props.uuid) in here and "driver unknown" not in here
