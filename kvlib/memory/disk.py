"""The disk tier: files in an offload folder, read and written with explicit positioned I/O, every byte counted.

An OffloadFolder is a private folder made inside the folder the user names (so two runs never share files), removed
when it is closed: at the end of a run, on an exception (the policy's finish runs in the session's `finally`), on
Ctrl-C (KeyboardInterrupt unwinds through the same `finally`), and at interpreter exit for anything still open.

The OS page cache would serve re-reads from memory and present them as disk reads. It is defeated as follows: at the
end of every forward pass (`settle`) each file is flushed to the disk (fdatasync) and its pages dropped from the cache
(posix_fadvise DONTNEED), and every read drops the pages it brought in; so what a later pass reads comes from the disk.
Where that cannot hold (a platform without posix_fadvise, a file system that ignores it), the kernel's own count of
bytes this process fetched from storage (/proc/self/io `read_bytes`) is read around the run: `Transfers.summary`
reports it beside the bytes kvlib read, and their difference as what the page cache served. That count is the whole
process's, so it bounds what the tier fetched from above; where the tier read nothing it is reported as 0. The flush
is kvlib's, a cost FlexGen never pays (its disk tier writes through numpy files and never syncs, so the page cache
may serve its reads): its seconds are counted apart (`disk_flush_s`), and a pass's time includes them.

A run killed outright (SIGKILL, a lost machine) leaves its folder behind; the next OffloadFolder made in the same root
sweeps the folders left there by this user's processes that are no longer alive (the folder's name carries its pid).

On CUDA the copy threads issue their host<->device copies on a side stream (CopyStream: FlexGen's load and store
streams), from pinned host memory (a host weight is pinned once, as FlexGen's `pin_weight`; a pageable buffer is
relayed through a pinned copy, as FlexGen's general_copy relays its unpinned KV), so that they overlap compute.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from kvlib.errors import UserError

DIRECTIONS = ("disk_to_host", "host_to_device", "device_to_host", "host_to_disk")
_OPEN: set[OffloadFolder] = set()
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def storage_read_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage (Linux /proc/self/io), None where unavailable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Transfers:
    """Bytes moved and seconds spent, per direction; thread-safe (the copy thread adds to it)."""

    def __init__(self, work=None):
        """work: the session's counter (kvlib.memory.work), told of every copy."""
        self.lock = threading.Lock()
        self.work = work
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self.storage_at_start = storage_read_bytes()
        self.uncounted_reads = 0  # read outside the run proper (weights put back at its end): off the kernel's count
        # the pass under way ("prefill" or "decode", set by the policy before each pass; a pass's loads are asked
        # for and waited on within it), so that what decoding reads off the disk is told apart from the prompt's
        self.phase = "prefill"
        self.disk_read_in_decode = 0
        # 4-bit coding and the disk flush: seconds apart from the copies' (kvlib's costs, not a tier's bandwidth)
        self.apart = {"kv_encode_s": 0.0, "kv_decode_s": 0.0, "disk_flush_s": 0.0}

    def add(self, direction: str, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.bytes[direction] += nbytes
            self.seconds[direction] += seconds
            phase = self.phase
            if direction == "disk_to_host" and phase == "decode":
                self.disk_read_in_decode += nbytes
        if self.work is not None:  # (outside this lock: the counter has its own)
            self.work.transfer(phase, direction, nbytes)

    def add_apart(self, what: str, seconds: float) -> None:
        with self.lock:
            self.apart[what] += seconds

    def summary(self) -> dict:
        now = storage_read_bytes()
        fetched = None if now is None or self.storage_at_start is None else \
            max(0, now - self.storage_at_start - self.uncounted_reads)
        if not self.bytes["disk_to_host"]:
            # the kernel counts the whole process: with no tier read, what it fetched (a library paged in lazily, a
            # file of another module) is not the tier's
            fetched = 0 if fetched is not None else None
        out = {}
        for d in DIRECTIONS:
            out[f"{d}_bytes"] = self.bytes[d]
            out[f"{d}_s"] = self.seconds[d]
        # the kernel's count of what really came off the disk (whole pages: a little above the bytes asked for where
        # reads are small), and what the page cache served (what was asked for beyond it)
        out["disk_to_host_bytes_in_decode"] = self.disk_read_in_decode
        out.update(self.apart)
        out["disk_read_bytes_from_storage"] = fetched
        out["disk_read_bytes_page_cache"] = None if fetched is None else max(0, self.bytes["disk_to_host"] - fetched)
        return out


class DiskFile:
    """One preallocated file of the offload folder; reads and writes at byte offsets, counted in `transfers`."""

    def __init__(self, path: Path, nbytes: int, transfers: Transfers):
        self.path, self.nbytes, self.transfers = path, nbytes, transfers
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise UserError(f"cannot create an offload file in {path.parent}: {e.strerror}") from None
        if hasattr(os, "posix_fadvise"):  # no readahead: it would cache the next layer's bytes before they are read
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            if nbytes:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(self.fd, 0, nbytes)  # the space is taken now: a full disk fails here
                else:
                    os.ftruncate(self.fd, nbytes)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"the offload folder {path.parent.parent} is full: {nbytes / 2**20:.1f} MiB "
                                f"could not be allocated") from None
            raise UserError(f"cannot allocate {nbytes} bytes in the offload folder {path.parent.parent}: "
                            f"{e.strerror}") from None

    def read(self, offset: int, nbytes: int, count: bool = True) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        t = time.perf_counter()
        got = os.preadv(self.fd, [memoryview(buf)], offset)
        if got != nbytes:
            raise OSError(errno.EIO, f"short read from {self.path}: {got} of {nbytes} bytes")
        drop(self.fd, offset, nbytes)
        if count:
            self.transfers.add("disk_to_host", nbytes, time.perf_counter() - t)
        else:
            self.transfers.uncounted_reads += nbytes
        return buf

    def write(self, offset: int, data: np.ndarray, count: bool = True) -> None:
        """count=False: a file's first contents (setting up, not moving data during the run), flushed and dropped
        from the page cache at once."""
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        t = time.perf_counter()
        try:
            done = os.pwritev(self.fd, [memoryview(data)], offset)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"the offload folder {self.path.parent.parent} is full") from None
            raise
        if done != data.nbytes:
            raise OSError(errno.EIO, f"short write to {self.path}: {done} of {data.nbytes} bytes")
        if count:
            self.transfers.add("host_to_disk", data.nbytes, time.perf_counter() - t)
        else:
            os.fdatasync(self.fd)
            drop(self.fd, 0, 0)

    def settle(self) -> None:
        """Flush what was written to the disk and drop the file's pages from the page cache (timed apart)."""
        t = time.perf_counter()
        os.fdatasync(self.fd)
        drop(self.fd, 0, 0)
        self.transfers.add_apart("disk_flush_s", time.perf_counter() - t)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def drop(fd: int, offset: int, nbytes: int) -> None:
    """Drop a byte range (nbytes 0: to the end) from the page cache, whole pages: a page only partly in the range
    would otherwise stay, and serve the next read of its other part."""
    if hasattr(os, "posix_fadvise"):
        start = offset - offset % PAGE
        end = 0 if nbytes == 0 else -(-(offset + nbytes) // PAGE) * PAGE
        os.posix_fadvise(fd, start, end - start if end else 0, os.POSIX_FADV_DONTNEED)


FOLDER_PREFIX = "kvlib-offload-"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep(root: Path) -> list[Path]:
    """Remove the offload folders in root that this user's dead processes left (a run killed before it could remove
    its own); returns them. Another user's folder, or a live process's, is left alone."""
    swept = []
    for folder in root.glob(f"{FOLDER_PREFIX}*"):
        pid = folder.name[len(FOLDER_PREFIX):].split("-")[0]
        try:
            mine = folder.is_dir() and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(folder)
    return swept


class OffloadFolder:
    """A private folder inside `root` for one run's files, removed on close (and at exit, whatever happened); the
    folders that killed runs left in root are swept first."""

    def __init__(self, root: str | Path, transfers: Transfers):
        root = Path(root).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
            sweep(root)
            self.path = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root))
        except OSError as e:
            raise UserError(f"the offload folder {root} is not writable ({e.strerror}); give another with "
                            f"--offload-dir") from None
        self.transfers = transfers
        self.files: list[DiskFile] = []
        _OPEN.add(self)

    def file(self, name: str, nbytes: int) -> DiskFile:
        f = DiskFile(self.path / name, nbytes, self.transfers)
        self.files.append(f)
        return f

    def settle(self) -> None:
        for f in self.files:
            f.settle()

    def bytes_allocated(self) -> int:
        return sum(f.nbytes for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []
        shutil.rmtree(self.path, ignore_errors=True)
        _OPEN.discard(self)


def read_bandwidth(root: str | Path, nbytes: int, chunk: int) -> dict:
    """The disk's sequential read rate through the tier's read call (DiskFile.read: positioned reads, each dropped
    from the page cache after it), in `chunk`-byte reads of one file written, flushed and dropped first. The tier's
    own reads are a unit's segment at a time (sizes set by the placement, often smaller than `chunk`), so this is the
    rate of large sequential reads, an upper bound on what the tier's reads can get. Returns bytes per second, with
    what the kernel says came off the storage and so what the page cache served (a folder on tmpfs: all of it)."""
    transfers = Transfers()
    folder = OffloadFolder(root, transfers)
    try:
        f = folder.file("probe.bin", nbytes)
        data = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
        for at in range(0, nbytes, chunk):
            f.write(at, data, count=False)
        start = time.perf_counter()
        for at in range(0, nbytes, chunk):
            f.read(at, min(chunk, nbytes - at))
        seconds = time.perf_counter() - start
    finally:
        folder.close()
    summary = transfers.summary()
    return {"bytes": nbytes, "chunk_bytes": chunk, "seconds": seconds, "read_bytes_per_s": nbytes / seconds,
            "read_bytes_from_storage": summary["disk_read_bytes_from_storage"],
            "read_bytes_page_cache": summary["disk_read_bytes_page_cache"]}


def pins(device: torch.device) -> bool:
    """Whether host buffers are pinned: where the device is CUDA (an asynchronous copy needs page-locked memory)."""
    return torch.device(device).type == "cuda"


def host_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t in host memory to be copied to `device` again and again: pinned where pins(device)."""
    t = t.cpu()
    return t.pin_memory() if pins(device) else t


class CopyStream:
    """Where a copy thread's host<->device copies run. On CUDA: a side stream of their own (FlexGen's load and store
    streams); a job first waits, on the copy thread, for the compute marked when it was asked for (`mark`, on the
    compute thread: what that compute wrote or freed is then safe to read or reuse), and ends with its copies done, so
    the compute thread may use what it loaded as soon as the job returns. Elsewhere copies are synchronous and these
    do nothing."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if pins(device) else None

    def mark(self):
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def submit(self, copier, fn, *args):
        """fn(*args) on the copy thread (copier, an executor), as a job after the compute issued so far."""
        return copier.submit(self._run, self.mark(), fn, args)

    def _run(self, after, fn, args):
        with self.job(after):
            return fn(*args)

    @contextmanager
    def job(self, after=None):
        if self.stream is None:
            yield
            return
        if after is not None:
            after.synchronize()
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()

    def sync(self) -> None:
        """The copies issued so far done (so that a timing of them is their time, not their issuing's)."""
        if self.stream is not None:
            self.stream.synchronize()

    def into(self, dst: torch.Tensor, src: torch.Tensor, transfers: Transfers | None) -> torch.Tensor:
        """Host tensor src copied into device tensor dst, counted host->device (transfers None: uncounted); on CUDA
        asynchronously on the side stream, a pageable src relayed through a pinned copy (as FlexGen's general_copy)."""
        start = time.perf_counter()
        if self.stream is not None and not src.is_pinned():
            src = src.pin_memory()
        dst.copy_(src, non_blocking=self.stream is not None)
        self.sync()
        if transfers is not None:
            transfers.add("host_to_device", src.nbytes, time.perf_counter() - start)
        return dst

    def to_device(self, t: torch.Tensor, device: torch.device, transfers: Transfers | None) -> torch.Tensor:
        """Host tensor t on the device; where the device is the host, t itself (nothing moves; its bytes are
        counted, in no time)."""
        if torch.device(device).type == "cpu":
            if transfers is not None:
                transfers.add("host_to_device", t.nbytes, 0.0)
            return t
        return self.into(torch.empty(t.shape, dtype=t.dtype, device=device), t, transfers)


@atexit.register
def _close_all() -> None:
    for folder in list(_OPEN):
        folder.close()
