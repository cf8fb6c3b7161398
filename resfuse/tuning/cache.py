"""The persistent tuning cache: one SQLite file of measured winners, keyed by everything that can stale them.

Entry points: `TuningCache(path)` with `get(key)`, `put(key, entry, replace=False)`, `lookup(key, machine)` (the
entry and whether it was checked there), `mark_checked(key, machine)`, `forget_checks()`, `entries()`, `clear()`,
`export(file)`, `import_(file)`; `Key` (the fields), `environment(device)` (the versions and GPU part) and
`machine(device)` (the GPU and driver a check ran on).
Used by tuning/profile.py and by `resfuse cache list | clear | export | import`.

Lessons kept (shared/design.md): TVM keyed on the shape alone and served stale hits, so the key holds the op,
shape, dtypes, strides/alignment, epilogue signature, GPU and SM count, library versions and the template
version. AITemplate could not update a forced re-profile, so `put(replace=True)` overwrites. Several
processes may tune at once: SQLite's own locking with a busy timeout, one short transaction per write. A
file that is corrupt or of another schema is set aside (renamed) with a warning and rebuilt.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sqlite3
import time
import warnings
from pathlib import Path

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    provider TEXT NOT NULL,
    config TEXT NOT NULL,
    times TEXT NOT NULL,
    created REAL NOT NULL
)"""
# The machines (machine(device)) on which an entry's choice passed the check before its first use (choose.py:
# cached_is_wrong), so a warm start on the same machine does not check it again. Not exported: a cache carried
# to another machine is checked there.
_CHECKS = """
CREATE TABLE IF NOT EXISTS checks (
    digest TEXT NOT NULL,
    machine TEXT NOT NULL,
    PRIMARY KEY (digest, machine)
)"""


@dataclasses.dataclass(frozen=True)
class Key:
    op: str  # "conv2d" | "gemm"
    shape: tuple  # the problem: conv (N, C, H, W, K, R, S, stride, padding, dilation); gemm (B, M, N, K)
    dtypes: tuple  # of every tensor argument
    strides: tuple  # of every tensor argument (layout and alignment follow from them)
    epilogue: str  # the signature (epilogue.py)
    gpu: str
    sms: int
    versions: tuple  # (("torch", ...), ("triton", ...), ("cuda", ...), ("cudnn", ...), ("template", ...))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Entry:
    provider: str  # "triton" | "epilogue" | "cudnn" | "aten"
    config: dict  # the provider's config (tile sizes, warps, stages, split-K...)
    times: dict  # measured seconds of the top candidates, by candidate name


# The version of select.py's correctness check, in every key: a choice that an earlier check let through is measured
# again. 2: the output checked is a run's over poisoned outputs (1 chose cuDNN engine configs that wrote nothing).
CHECK_VERSION = 2


def environment(device, template_version: str) -> tuple[str, int, tuple]:
    """(GPU name, SM count, versions) of this process and device, for a Key."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if getattr(device, "type", device) == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, sms = props.name, props.multi_processor_count
    else:
        gpu, sms = "cpu", 0
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    versions = (("torch", torch.__version__), ("triton", triton_version), ("cuda", str(torch.version.cuda)),
                ("cudnn", str(cudnn)), ("template", template_version), ("check", str(CHECK_VERSION)))
    return gpu, sms, versions


@functools.cache
def machine(device) -> str:
    """This GPU and its driver, which a Key leaves out: a choice checked here need not be checked again here, but
    a cache carried to another card or driver is checked there."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    try:  # torch has no public API for the driver's version; Linux's NVIDIA driver names itself here
        driver = Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        driver = "unknown"
    return f"{getattr(props, 'uuid', props.name)} driver {driver}"


class TuningCache:
    def __init__(self, path: str | Path, timeout_s: float = 60.0):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open_or_rebuild()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)

    def _open_or_rebuild(self) -> None:
        try:
            with self._connect() as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if tables and (version != SCHEMA_VERSION or "entries" not in tables):
                    raise sqlite3.DatabaseError(f"schema version {version}, tables {sorted(tables)}")
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_SCHEMA)
                db.execute(_CHECKS)  # added within schema 1: a file made before it gains the table
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                db.execute("SELECT COUNT(*) FROM entries").fetchone()
        except sqlite3.DatabaseError as e:
            aside = self.path.with_name(f"{self.path.name}.bad-{int(time.time() * 1000)}")
            warnings.warn(f"resfuse: tuning cache {self.path} is unusable ({e}); moved to {aside}, rebuilding")
            self.path.rename(aside)
            for sidecar in ("-wal", "-shm"):
                Path(str(self.path) + sidecar).unlink(missing_ok=True)
            self._open_or_rebuild()

    def get(self, key: Key) -> Entry | None:
        with self._connect() as db:
            row = db.execute("SELECT provider, config, times FROM entries WHERE digest=?",
                             (key.digest(),)).fetchone()
        return None if row is None else Entry(row[0], json.loads(row[1]), json.loads(row[2]))

    def put(self, key: Key, entry: Entry, replace: bool = False) -> bool:
        """Store a winner; an existing entry is kept unless `replace` (force-retune). True if written."""
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            cur = db.execute(f"{verb} INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                             (key.digest(), json.dumps(dataclasses.asdict(key), sort_keys=True), entry.provider,
                              json.dumps(entry.config, sort_keys=True), json.dumps(entry.times), time.time()))
            if cur.rowcount > 0:  # a replaced choice's checks were of the old one
                db.execute("DELETE FROM checks WHERE digest=?", (key.digest(),))
            db.execute("COMMIT")
            return cur.rowcount > 0

    def lookup(self, key: Key, machine: str) -> tuple[Entry | None, bool]:
        """The stored entry (None if none) and whether its choice passed the check on `machine`, in one read."""
        digest = key.digest()
        with self._connect() as db:
            row = db.execute("SELECT provider, config, times, EXISTS(SELECT 1 FROM checks WHERE digest=? AND "
                             "machine=?) FROM entries WHERE digest=?", (digest, machine, digest)).fetchone()
        if row is None:
            return None, False
        return Entry(row[0], json.loads(row[1]), json.loads(row[2])), bool(row[3])

    def mark_checked(self, key: Key, machine: str) -> None:
        with self._connect() as db:
            db.execute("INSERT OR IGNORE INTO checks VALUES (?, ?)", (key.digest(), machine))

    def forget_checks(self) -> int:
        """Drop every check, as a cache carried to another machine has none: each choice is checked on next use."""
        with self._connect() as db:
            return db.execute("DELETE FROM checks").rowcount

    def entries(self) -> list[tuple[dict, Entry]]:
        with self._connect() as db:
            rows = db.execute("SELECT key, provider, config, times FROM entries ORDER BY created").fetchall()
        return [(json.loads(k), Entry(p, json.loads(c), json.loads(t))) for k, p, c, t in rows]

    def clear(self) -> int:
        with self._connect() as db:
            db.execute("DELETE FROM checks")
            return db.execute("DELETE FROM entries").rowcount

    def export(self, file: str | Path) -> int:
        rows = [{"key": k, "entry": dataclasses.asdict(e)} for k, e in self.entries()]
        Path(file).write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": rows}, indent=1))
        return len(rows)

    def import_(self, file: str | Path, replace: bool = False) -> int:
        data = json.loads(Path(file).read_text())
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"{file}: cache export of schema {data.get('schema')}, expected {SCHEMA_VERSION}")
        written = 0
        for row in data["entries"]:
            k = row["key"]
            key = Key(**{f.name: _tuples(k[f.name]) for f in dataclasses.fields(Key)})
            written += self.put(key, Entry(**row["entry"]), replace=replace)
        return written


def _tuples(v):
    """JSON turns tuples into lists; keys are compared by their JSON, so restore the tuples."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v
