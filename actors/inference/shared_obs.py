"""Observations through shared memory, between an env runner and an inference server on one node.

A step of an Atari-sized run is 113 kB of frames for four sub-envs, a batch of 256 is 7 MB; through a
codec frame over ZeroMQ each byte is copied into the frame, checksummed, copied through the socket and
checksummed again. When the runner and its server share a node, the runner writes its observations into
a memory-mapped file under ``/dev/shm`` (``ObsSegment``) and sends only where they are
(``protocols.inference``, ``"obs_shm"``); the server maps the file once (``SegmentMaps``), checks the block's
shape and dtype (which the request states, so the runner cannot change them afterwards) when the request
arrives, and copies it from the segment straight into its rows of the batch when the batch runs
(``actors.inference.batching.gather_blocks``). A runner keeps one request out per lane and writes that lane's
segment again only after the answer, so what is copied is what the runner sent.

Lifetime: the runner creates the file and unlinks its name once the server has answered a request from
it (the server then holds its own mapping), so a runner killed later leaves nothing behind in
``/dev/shm``; only a runner killed between creating a segment and its first answer can leave one file
(named ``runnel-obs-<pid>-...``). A server that does not know the name (it was recreated, or it runs in
a container with another ``/dev/shm``) answers ``shm_unavailable``; the runner writes a new segment and
asks again, and after a second refusal sends its observations inline for good.

Trust: this is a transport between two processes of one job, one user, one node -- external clients
never use it (they send frames). A block is checked against the space as inline observations are; the one thing it cannot guard against is a runner process that shrinks its own file
after the server mapped it (reading past the end would stop the server with SIGBUS), which no runnel
code does.

Only single-array observations of at least ``MIN_BYTES`` a step go this way; anything else (CartPole's
four floats, dict observations) is inline, where the frame costs less than the file.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

from protocols.errors import ProtocolError
from protocols.inference import SharedBlock

SHM_DIR = "/dev/shm"
PREFIX = "runnel-obs-"
MIN_BYTES = 32 << 10
"""Smallest observation block (bytes a step) worth a segment."""
MAX_SEGMENTS = 4096
"""Segments a server keeps mapped (one per runner it serves); beyond, the oldest is dropped."""


def shared_memory_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class ObsSegment:
    """A runner's segment: ``write(obs)`` puts one step's observations in it and says where."""

    def __init__(self, worker_index: int) -> None:
        self.worker_index = worker_index
        self.path: str | None = None
        self.linked = False
        """The file still has its name (the server has not answered from it yet)."""
        self._mm: mmap.mmap | None = None

    def write(self, obs: np.ndarray) -> SharedBlock:
        if self._mm is None or obs.nbytes > len(self._mm):
            self.renew(obs.nbytes)
        np.ndarray(obs.shape, obs.dtype, buffer=self._mm)[...] = obs
        return SharedBlock(self.path, obs.shape, obs.dtype)

    def renew(self, nbytes: int | None = None) -> None:
        """A new file (bigger, or because the server lost the old one)."""
        size = max(nbytes or 0, len(self._mm) if self._mm is not None else 0, mmap.PAGESIZE)
        self.close()
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-{self.worker_index}-", dir=SHM_DIR)
        try:
            # reserved now: a full /dev/shm (a container's 64 MB) then fails here with ENOSPC, not with a
            # SIGBUS at the first write into a page tmpfs cannot give
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.linked = path, True

    def answered(self) -> None:
        """The server answered from this segment: it has it mapped, so the name can go."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.answered()
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class SegmentUnavailable(Exception):
    """The named segment cannot be opened here (another node, or a name already unlinked)."""


class SegmentMaps:
    """A server's mappings of its runners' segments, by path (one segment per runner and lane: a runner that
    keeps two requests out writes each into its own)."""

    def __init__(self, max_segments: int = MAX_SEGMENTS) -> None:
        self.max_segments = max_segments
        self._maps: dict[str, mmap.mmap] = {}
        self._of_runner: dict[tuple[int, int], str] = {}

    def view(self, runner: int, block: SharedBlock, lane: int = 0) -> np.ndarray:
        """A read-only view of the block. It keeps the mapping alive while it lives (``_drop`` leaves a mapping
        with views to them), so a request queued with it can be copied from later."""
        mm = self._maps.get(block.path)
        if mm is None:
            mm = self._open((runner, lane), block.path)
        shape, dtype = block.shape, block.dtype
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > len(mm):
            raise ProtocolError(f"'obs_shm' block of shape {list(shape)} and dtype {dtype.str} needs {nbytes} bytes; "
                                f"the segment has {len(mm)}")
        return np.ndarray(shape, dtype, buffer=mm)

    def _open(self, runner: tuple[int, int], path: str) -> mmap.mmap:
        directory, name = os.path.split(path)
        if directory != SHM_DIR or not name.startswith(PREFIX) or os.sep in name or name in (".", ".."):
            raise ProtocolError(f"'obs_shm' path must name a file {SHM_DIR}/{PREFIX}..., got {path!r:.200}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise SegmentUnavailable(f"cannot open {path}: {err.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise SegmentUnavailable(f"{path} is empty")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        old = self._of_runner.get(runner)
        if old is not None and old != path:
            self._drop(old)
        while len(self._maps) >= self.max_segments:
            self._drop(next(iter(self._maps)))
        self._maps[path] = mm
        self._of_runner[runner] = path
        return mm

    def _drop(self, path: str) -> None:
        mm = self._maps.pop(path, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with that view
                pass

    def close(self) -> None:
        for path in list(self._maps):
            self._drop(path)
        self._of_runner.clear()
