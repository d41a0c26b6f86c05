"""The disk block store (ember.kv.disk) with real files and real process kills.

The oracle for every stored block is its content as a pure function of its key
(``payload_of``), so a reader can tell a right block from a wrong one without
trusting the store.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kv_disk_blocks import FP, key_of, open_store, record

from ember.kv import disk
from ember.kv.disk import DiskStore


def test_round_trip_through_a_restart(tmp_path):
    store = open_store(tmp_path)
    for i in range(20):
        assert store.put(record(i))
    assert store.get(key_of(3)) == record(3)  # readable while still queued or written
    store.close()
    again = open_store(tmp_path)
    assert len(again) == 20
    for i in range(20):
        assert again.get(key_of(i)) == record(i)
    assert again.get(key_of(99)) is None
    assert again.stats.hits == 20 and again.stats.misses == 1 and again.stats.corrupt == 0
    again.close()


def test_another_fingerprint_or_version_is_never_served(tmp_path):
    store = open_store(tmp_path)
    store.put(record(1))
    store.close()
    for fp in (disk.fingerprint("test-model", "f16", 16), disk.fingerprint("other", "f32", 16)):
        other = DiskStore(tmp_path, fp, 1 << 30)
        assert len(other) == 0 and other.get(key_of(1)) is None
        other.close()
    # the same file moved into another fingerprint's directory: whole, but foreign
    fp2 = disk.fingerprint("other", "f32", 16)
    src = next(open_store(tmp_path).dir.glob("*.kvb"))
    dst_dir = tmp_path / fp2.hex()[:32]
    os.replace(src, dst_dir / src.name)
    other = DiskStore(tmp_path, fp2, 1 << 30)
    assert len(other) == 1 and other.get(key_of(1)) is None and other.stats.corrupt == 0
    other.close()


def stored_file(tmp_path: Path, i: int = 1) -> tuple[Path, bytes]:
    store = open_store(tmp_path)
    store.put(record(i, payload=64))
    store.close()
    path = store.dir / (key_of(i).hex() + disk.SUFFIX)
    return path, path.read_bytes()


def test_every_byte_flip_is_detected_and_deleted(tmp_path):
    path, data = stored_file(tmp_path)
    for at in range(len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(flipped))
        store = open_store(tmp_path)
        assert store.get(key_of(1)) is None, f"a flip at byte {at} was served"
        assert store.stats.corrupt == 1 and not path.exists(), at
        store.close()


def test_every_truncation_is_detected(tmp_path):
    path, data = stored_file(tmp_path)
    for n in range(len(data)):
        path.write_bytes(data[:n])
        store = open_store(tmp_path)
        assert store.get(key_of(1)) is None and store.stats.corrupt == 1, n
        store.close()
    path.write_bytes(data + b"\0")  # and an extension
    store = open_store(tmp_path)
    assert store.get(key_of(1)) is None and store.stats.corrupt == 1


def test_capacity_is_respected_least_recently_used_first(tmp_path):
    size = len(disk.encode(FP, record(0)))
    store = open_store(tmp_path, capacity=5 * size)
    for i in range(5):
        store.put(record(i))
    store.flush()
    store.get(key_of(0))  # now the most recently used
    for i in range(5, 8):
        store.put(record(i))
    store.flush()
    on_disk = sum(p.stat().st_size for p in store.dir.glob("*.kvb"))
    assert on_disk <= 5 * size and store.size_bytes == on_disk
    assert key_of(0) in store and all(key_of(i) not in store for i in (1, 2, 3))
    assert store.stats.evicted == 3
    store.close()
    assert len(open_store(tmp_path, capacity=2 * size)) == 2  # a smaller budget at restart


def test_a_full_write_queue_drops_instead_of_blocking(tmp_path):
    store = open_store(tmp_path, queue_bytes=1)
    assert not store.put(record(1))
    assert store.stats.dropped == 1
    store.close()


# ---------------------------------------------------------------- crash safety
_WRITER = """
import sys, hashlib
sys.path.insert(0, {tests!r})
from kv_disk_blocks import open_store, record
from pathlib import Path
store = open_store(Path({root!r}), fsync={fsync!r})
i = {first}
while True:
    store.put(record(i))
    i += 1
    if i % 8 == 0:  # as an engine does: a few blocks at a time, written while it goes on
        store.flush()
        print(i, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fsync", ["never", "always"])
def test_kill_9_the_writer_at_random_instants(tmp_path, fsync):
    """SIGKILL a writing process at random instants, 30 times per fsync policy; after
    each, a new store serves only blocks whose bytes are exactly right."""
    seed = int(os.environ.get("EMBER_TEST_SEED") or random.randrange(2**32))
    print(f"seed {seed}")
    rng = random.Random(seed)
    first, served = 0, 0
    # a block served right is read again in a later trial only if its file changed (no
    # writer touches another's keys; a rename makes a new inode), and in the last trial
    # all are: re-reading thousands of unchanged files every trial made it quadratic
    verified: dict[str, tuple[int, int, int]] = {}
    for trial in range(30):
        code = _WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path),
                              fsync=fsync, first=first)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # it has started writing
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = open_store(tmp_path)
        assert not list(store.dir.glob("*.tmp")), "a torn temp file survived the restart"
        for path in store.dir.glob("*.kvb"):
            st = path.stat()
            if trial < 29 and verified.get(path.name) == (st.st_ino, st.st_size,
                                                          st.st_mtime_ns):
                continue
            key = bytes.fromhex(path.name[:-len(disk.SUFFIX)])
            got = store.get(key)
            if got is not None:  # block i has tokens i..i+15: recompute what it must be
                assert got == record(got.tokens[0]) and got.key == key, f"trial {trial}"
                served += 1
                verified[path.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        # renames are atomic: a killed process leaves no torn block file (only a power
        # loss without fsync could, and the checksum would catch it)
        assert store.stats.corrupt == 0, f"trial {trial}: a torn block file"
        first += 1_000_000
        store.close()
    assert served > 30, "the writer hardly wrote anything: the trials tested nothing"


def test_a_purge_while_the_writer_holds_the_tenants_block_leaves_nothing(tmp_path):
    """The writer took a batch off the queue and is writing it when the tenant is purged:
    the purge waits for that batch to land, then deletes it (it used to drop the queued
    copy only, and the file appeared after the purge had looked)."""
    import threading

    store = open_store(tmp_path)
    writing, release = threading.Event(), threading.Event()
    real = store._write

    def slow(batch):
        writing.set()
        release.wait(10)
        real(batch)

    store._write = slow
    store.put(record(1, salt=b"tenant-a"))
    assert writing.wait(10)  # the batch is in the writer's hands
    done = []
    purge = threading.Thread(target=lambda: done.append(
        store.purge(lambda salt: salt == b"tenant-a")))
    purge.start()
    time.sleep(0.2)
    release.set()
    purge.join(10)
    assert done and done[0][0] >= 1
    store.close()
    assert key_of(1) not in store and not list(tmp_path.rglob("*.kvb"))
