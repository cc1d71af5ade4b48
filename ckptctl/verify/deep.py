"""``verify --deep``: read every byte once, hash it, and decode floats for NaN/Inf/all-zero; the sha256
of each file is compared with the manifest's, and a torch zip archive's records with their CRC-32
(:func:`~ckptctl.verify.pickles.zip_crc_findings`). Nothing here imports torch; memory stays at a few
windows per file whatever its size.

The fast path (:func:`scan_files`, the default): two workers; each file is read and hashed in order by
one (hashlib releases the GIL), in windows of at most 1 MiB, and each window's floats are checked right
after its hash, while it is in cache, by that worker, or by the other one once it has no file left: one
large file keeps both cores busy, and so does the last of many. The reference (``fast=False``):
:func:`scan_file` of two files at a time, each by a reader thread and a decoder thread. Floats are
classified from their bits, the same for every format numpy lacks (bfloat16, the fp8 family): an
exponent of all ones is Inf (mantissa zero) or NaN; a value is zero when every bit but the sign is zero
(:func:`check_bits`, and :func:`check_bits_fast` beside it).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import names as N
from ckptctl.format.header import Header, TensorInfo
from ckptctl.threads import WORKERS, Buffers, HelpingPool, check, ordered_map
from ckptctl.verify.context import DEEP_NOT_ASKED, Context
from ckptctl.verify.floatbits import NOT_DECODED, FloatBits, TensorScanner, TensorStats, check_bits_fast

CHUNK_BYTES = 8 * 1024 * 1024
BUFFERS = 3
MIN_CHUNK_BYTES = 64


@dataclass
class DeepResult:
    sha256: str
    bytes_read: int
    findings: list[Finding] = field(default_factory=list)


def window_bytes(chunk_bytes: int) -> int:
    """The size of one read buffer for ``VerifyOptions.chunk_bytes``."""
    return max(MIN_CHUNK_BYTES, int(chunk_bytes))


def open_unbuffered(path: str | os.PathLike[str]) -> BinaryIO:
    """A weights file opened the way ``--deep`` reads it: raw, every read straight into a caller's buffer."""
    return open(path, "rb", buffering=0)


def read_windows(f: BinaryIO, buf: bytearray, start: int, length: int) -> Iterator[memoryview]:
    """The bytes ``[start, start + length)`` of ``f`` in windows of ``len(buf)`` bytes (the last one
    shorter), each read into ``buf`` (reused: a window is valid until the next one is asked for).
    Raises OSError when the file ends first."""
    f.seek(start)
    view = memoryview(buf)
    for at in range(0, length, len(buf)):
        want = min(len(buf), length - at)
        got = _fill(f, view[:want])
        if got < want:
            raise OSError(f"file ended at offset {start + at + got:,}, before {start + length:,}")
        yield view[:want]


def _fill(f: BinaryIO, view: memoryview) -> int:
    """Read into all of ``view`` unless the file ends first; returns the bytes read."""
    got = 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    return got


def _plan(header: Header | None) -> list[tuple[int, int, TensorInfo]]:
    """(absolute begin, absolute end, tensor) for every tensor with data, in file order."""
    if header is None or not header.ok:
        return []
    base = header.data_start
    return [(base + t.begin, base + t.end, t) for t in header.tensors.values() if t.end > t.begin]


def scan_file(path: str, display: str, header: Header | None = None, *, chunk_bytes: int = CHUNK_BYTES,
              progress: Callable[[int], None] | None = None, stop: threading.Event | None = None,
              cast_to: str | None = None) -> DeepResult:
    """Hash ``path`` and, when ``header`` is a valid safetensors header, check its floats
    (``cast_to``: the dtype the loader casts them to, whose range they must fit).

    Raises OSError when the file cannot be read (or shrinks while it is read), and
    :class:`~ckptctl.threads.Stopped` between two chunks once ``stop`` is set.
    """
    plan = _plan(header)
    scanners = {t.name: TensorScanner(t, cast_to) for _, _, t in plan}
    h = hashlib.sha256()
    free: queue.Queue[bytearray] = queue.Queue()
    work: queue.Queue[tuple[bytearray, int, int] | None] = queue.Queue(maxsize=BUFFERS)
    errors: list[BaseException] = []

    def decode() -> None:
        idx = 0
        try:
            while True:
                item = work.get()
                if item is None:
                    return
                buf, start, n = item
                end = start + n
                mv = memoryview(buf)[:n]
                try:
                    while idx < len(plan) and plan[idx][1] <= start:
                        idx += 1
                    j = idx
                    while j < len(plan) and plan[j][0] < end:
                        b, e, t = plan[j]
                        lo, hi = max(b, start), min(e, end)
                        if hi > lo:
                            scanners[t.name].feed(mv[lo - start:hi - start])
                        j += 1
                finally:
                    del mv
                    free.put(buf)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the reader thread
            errors.append(exc)
            while True:  # keep draining so the reader never blocks
                item = work.get()
                if item is None:
                    return
                free.put(item[0])

    total = 0
    with open_unbuffered(path) as f:
        expected = os.fstat(f.fileno()).st_size
        # buffers no larger than the file: a small file does not pay for zeroing chunk_bytes buffers
        size = min(window_bytes(chunk_bytes), max(expected, MIN_CHUNK_BYTES))
        for _ in range(BUFFERS):
            free.put(bytearray(size))
        worker = threading.Thread(target=decode, name="ckptctl-verify-decode", daemon=True) if plan else None
        if worker:
            worker.start()
        try:
            while True:
                buf = free.get()
                check(stop)
                n = f.readinto(buf)
                if not n:
                    free.put(buf)
                    break
                h.update(memoryview(buf)[:n])
                if worker:
                    work.put((buf, total, n))
                else:
                    free.put(buf)
                total += n
                if progress:
                    progress(n)
        finally:
            if worker:
                work.put(None)
                worker.join()
    if errors:
        raise errors[0]
    if total != expected:
        raise OSError(f"file changed size while it was read ({expected} -> {total} bytes)")
    return DeepResult(h.hexdigest(), total, _findings(display, plan, scanners, header))


FAST_WINDOW = 1 << 20  # the fast path's window: hashed, then scanned while it is still in cache


class _SharedScan:
    """One file on the fast path (:func:`scan_files`). A window never ends inside a float element,
    and the counts are sums: which worker scans which window, in what order, cannot change them."""

    def __init__(self, job: tuple[str, str, Header | None, int], window: int,
                 check: Callable[[FloatBits, Any, TensorStats], None], cast_to: str | None = None) -> None:
        self.job, self.window, self.check = job, window, check
        self.path, self.display, self.header, _ = job
        self.plan = _plan(self.header)  # in offset order (Header.tensors is)
        self.begins = [b for b, _, _ in self.plan]
        self.scanners = {t.name: TensorScanner(t, cast_to) for _, _, t in self.plan}
        self.lock = threading.Lock()
        self.buffers: Buffers | None = None
        self.outcome: DeepResult | OSError | None = None

    def cut(self, start: int, end: int) -> int:
        """Where the window from ``start`` ends, at most ``end``: never inside a float element."""
        i = bisect.bisect_right(self.begins, end) - 1
        if i >= 0:
            b, e, t = self.plan[i]
            size = self.scanners[t.name].itemsize
            if b < end < e and b + (end - b) // size * size > start:
                return b + (end - b) // size * size
        return end

    def scan(self, buf: bytearray, start: int, end: int) -> None:
        """Check the floats of the window ``buf`` holds (``[start, end)`` of the file), free ``buf``."""
        found = []
        with memoryview(buf) as mv:
            i = max(0, bisect.bisect_right(self.begins, start) - 1)
            while i < len(self.plan) and self.plan[i][0] < end:
                b, e, t = self.plan[i]
                sc = self.scanners[t.name]
                lo, hi = max(b, start), min(e, end)
                hi -= (hi - lo) % sc.itemsize
                if sc.fb is not None and hi > lo:
                    found.append((sc.stats, TensorStats(limit=sc.stats.limit)))
                    self.check(sc.fb, mv[lo - start:hi - start], found[-1][1])
                i += 1
        assert self.buffers is not None
        self.buffers.give(buf)
        with self.lock:
            for total, st in found:
                total.nan, total.inf = total.nan + st.nan, total.inf + st.inf
                total.nonzero = total.nonzero or st.nonzero
                total.over += st.over

    def run(self, pool: HelpingPool, progress: Callable[[int], None] | None) -> DeepResult:
        """Read and hash the file; each window's scan runs here or is handed to the pool."""
        h, pos = hashlib.sha256(), 0
        with open_unbuffered(self.path) as f:
            size = os.fstat(f.fileno()).st_size
            window = min(self.window, max(size, MIN_CHUNK_BYTES))
            self.buffers = Buffers(window, pool.backlog + pool.workers)
            while pos < size:
                check(pool.stop)
                end = self.cut(pos, min(pos + window, size))
                buf = self.buffers.take(pool.stop)
                with memoryview(buf)[:end - pos] as view:
                    if (got := _fill(f, view)) < len(view):
                        raise OSError(f"file changed size while it was read ({size} -> {pos + got} bytes)")
                    h.update(view)
                task = functools.partial(self.scan, buf, pos, end)
                if not (self.plan and pool.offer(task)):
                    task()
                if progress:
                    progress(end - pos)
                pos = end
            if f.read(1):
                raise OSError(f"file changed size while it was read ({size} -> {os.fstat(f.fileno()).st_size} bytes)")
        self.outcome = DeepResult(h.hexdigest(), pos)  # the findings once every window is scanned
        return self.outcome


def scan_files(files: Sequence[tuple[str, str, Header | None, int]], *, chunk_bytes: int = CHUNK_BYTES,
               progress: Callable[[str, str, int], None] | None = None, fast: bool = True,
               workers: int = WORKERS, cast_to: str | None = None) -> list[DeepResult | OSError]:
    """:func:`scan_file` of every ``(path, display, header, size shown)``: one result per file, in
    order, an OSError for a file that could not be read. ``progress(event, display, amount)`` is
    called from the workers ("file" with the size, "bytes" read, "done"), one call at a time.

    ``fast`` (the default): :class:`_SharedScan` on a :class:`~ckptctl.threads.HelpingPool` of
    ``workers`` threads, windows of at most :data:`FAST_WINDOW` bytes, floats checked by
    :func:`check_bits_fast`. Off: the reference, :func:`scan_file` of two files at a time with
    :func:`check_bits`. Both give the same results."""
    lock = threading.Lock()

    def report(event: str, shown: str, amount: int) -> None:
        if progress is not None:
            with lock:
                progress(event, shown, amount)

    def one(job: Any, stop: threading.Event | None = None) -> DeepResult | OSError:
        s = job if isinstance(job, _SharedScan) else None
        path, shown, hdr, size = s.job if s else job
        report("file", shown, size)
        counted = (lambda n: report("bytes", shown, n)) if progress else None
        try:
            return s.run(pool, counted) if s else scan_file(path, shown, hdr, chunk_bytes=chunk_bytes, stop=stop,
                                                            progress=counted, cast_to=cast_to)
        except OSError as exc:
            if s:
                s.outcome = exc
            return exc
        finally:
            report("done", shown, 0)

    if not fast:
        with ordered_map(one, files) as results:
            return list(results)
    window = min(window_bytes(chunk_bytes), FAST_WINDOW)
    scans = [_SharedScan(job, window, check_bits_fast, cast_to) for job in files]
    pool = HelpingPool(workers)
    pool.run(one, scans)
    return [s.outcome if isinstance(s.outcome, OSError) else DeepResult(  # type: ignore[union-attr]
        s.outcome.sha256, s.outcome.bytes_read, _findings(s.display, s.plan, s.scanners, s.header)) for s in scans]


def _findings(display: str, plan: list[tuple[int, int, TensorInfo]], scanners: dict[str, TensorScanner],
              header: Header | None) -> list[Finding]:
    out: list[Finding] = []
    skipped: set[str] = set()
    zero_vectors: list[str] = []
    if header is not None and header.ok:
        skipped = {t.dtype for t in header.tensors.values() if t.dtype in NOT_DECODED}
    for _, _, t in plan:
        st = scanners[t.name].stats
        if scanners[t.name].fb is None:
            continue
        if st.nan:
            out.append(Finding("deep.nan", ERROR, display,
                               f"tensor {t.name!r} holds {st.nan} NaN values (a NaN weight turns every output it "
                               "reaches into NaN)", "check the training run "
                               "that produced it (loss spike, overflow) before publishing", t.name, {"count": st.nan}))
        if st.over:
            out.append(Finding("deep.dtype_overflow", ERROR, display,
                               f"tensor {t.name!r} ({t.dtype}) holds {st.over} values beyond float16's range "
                               "(|x| >= 65520): config.json's dtype makes the loader cast them to float16, where they "
                               "become inf, and the outputs they reach NaN", "set config.json's dtype to the stored "
                               f"{t.dtype.lower()}, or rescale the weights before a float16 export", t.name,
                               {"count": st.over, "dtype": t.dtype}))
        if st.inf:
            out.append(Finding("deep.inf", WARNING, display,
                               f"tensor {t.name!r} holds {st.inf} infinite values", "check the training run "
                               "that produced it (overflow in a low-precision cast?)", t.name, {"count": st.inf}))
        numel = t.numel
        if not st.nonzero and numel > 1 and t.dtype not in NOT_DECODED:
            # a matrix has two dims above 1: BART's final_logits_bias [1, vocab] is a vector (zero in real BART)
            if sum(1 for n in t.shape if n > 1) >= 2:
                out.append(Finding("deep.all_zero", WARNING, display,
                                   f"tensor {t.name!r} {list(t.shape)} is all zeros",
                                   "a zero-filled weight matrix usually means a failed or interrupted write "
                                   "(or an untrained LoRA B); re-export it", t.name))
            else:
                zero_vectors.append(t.name)
    if zero_vectors:
        out.append(Finding("deep.all_zero_vector", INFO, display,
                           f"{len(zero_vectors)} vectors are all zeros ({', '.join(zero_vectors[:3])}"
                           f"{', ...' if len(zero_vectors) > 3 else ''}); normal for fresh biases and some norms",
                           None, zero_vectors[0], {"tensors": zero_vectors[:200]}))
    if skipped:
        out.append(Finding("deep.not_decoded", INFO, display,
                           f"values of dtype {', '.join(sorted(skipped))} are hashed but not checked for NaN/zero",
                           None))
    return out


SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def deep_step(ctx: Context, *, fast: bool | None = None) -> str | None:
    """Every weights file that was read, every DCP file, every file the manifest lists: hashed,
    floats decoded (safetensors), the digest compared with the manifest's. ``fast``: see
    :func:`scan_files`; unset, the command's ``reading.fast`` (off with ``CKPTCTL_FAST_METADATA=0``)."""
    if not ctx.options.deep:
        return DEEP_NOT_ASKED
    queue = dict(ctx.deep_queue)
    manifest = ctx.manifest or {}
    for name in manifest:
        queue.setdefault(name, None)
    # results in queue order: the findings come out as from one file at a time
    todo = []
    for name, hdr in queue.items():
        rec = ctx.record(name, "extra")
        if rec.sha256 is None:
            todo.append((name, hdr, rec.size or 0))
    results = scan_files([(str(ctx.root / name), ctx.disp(name), hdr, size) for name, hdr, size in todo],
                         chunk_bytes=ctx.options.chunk_bytes, progress=ctx.progress,
                         fast=ctx.reading.fast if fast is None else fast, cast_to=_cast_to(ctx))
    scanned = dict(zip((name for name, _, _ in todo), results))
    for name in queue:
        rec = ctx.record(name, "extra")
        if name not in scanned:  # a component's file the root's manifest lists: read once
            _compare(ctx, name, rec.sha256, manifest)  # type: ignore[arg-type]
            continue
        dr = scanned[name]
        if isinstance(dr, OSError):
            ctx.io(name, dr)
            continue
        rec.sha256 = dr.sha256
        ctx.result.bytes_read += dr.bytes_read
        ctx.extend(dr.findings)
        hdr = queue[name]
        if hdr is not None and hdr.ok:
            try:
                tail = zero_tail(str(ctx.root / name), ctx.disp(name), hdr)
            except OSError as exc:
                ctx.io(name, exc)
                continue
            if tail is not None:
                ctx.extend([tail])
        _compare(ctx, name, dr.sha256, manifest)
        _compare_blob(ctx, name, dr.sha256)
        if queue[name] is None and name.endswith(N.PICKLE_SUFFIXES):  # torch.load never checks CRCs
            ctx.extend(_zip_crcs(ctx, name))
    return None


def _cast_to(ctx: Context) -> str | None:
    """The dtype config.json makes transformers build the model in (and cast every weight to)."""
    from ckptctl.verify.consistency_tokens import quiet_json
    from ckptctl.config_fields import config_dtype

    ok, cfg = quiet_json(ctx, N.CONFIG)
    return config_dtype(cfg) if ok else None


TAIL_BLOCK = 1 << 20


def zero_tail(path: str, display: str, header: Header) -> Finding | None:
    """``deep.zero_tail``: the file's bytes are zeros from inside one tensor to its end, across at
    least one whole tensor after it: what a preallocating downloader or copy leaves when it stops
    (the size and the header are right; the loader reads the zeros as weights). A run that starts
    exactly where a tensor starts (a LoRA B matrix at the end, a fresh bias) is not this. Read from
    the end backwards, one block at a time, until a nonzero byte. Opened as the scan opened it (a
    cache snapshot's file is a link to its blob; screening took out links that leave the tree)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size
        pos = end
        while pos > header.data_start:
            n = min(TAIL_BLOCK, pos - header.data_start)
            block = os.pread(fd, n, pos - n)
            if len(block) < n:
                raise OSError(f"file changed size while it was read ({end} -> {pos - n + len(block)} bytes)")
            stripped = block.rstrip(b"\0")
            if stripped:
                pos = pos - n + len(stripped)
                break
            pos -= n
    finally:
        os.close(fd)
    plan = _plan(header)
    inside = next((t for b, e, t in plan if b < pos < e), None)
    whole = [t.name for b, e, t in plan if b >= pos and e > b]
    if inside is None or not whole or end - pos <= 0:
        return None
    return Finding("deep.zero_tail", ERROR, display,
                   f"the last {end - pos:,} bytes are zeros, from inside tensor {inside.name!r} to the end of the file "
                   f"({len(whole)} whole tensors in them): a download or copy that stopped early (the size and header "
                   "are right, the data is not); the loader reads the zeros as weights",
                   "download or copy the file again, and compare it with its source (--deep with a manifest)",
                   inside.name, {"bytes": end - pos, "tensors": whole[:50]})


def _zip_crcs(ctx: Context, name: str) -> list[Finding]:
    from ckptctl.verify.pickles import zip_crc_findings  # here: zipfile is not verify's startup

    return zip_crc_findings(str(ctx.root / name), ctx.disp(name))


def _compare_blob(ctx: Context, name: str, sha256: str) -> None:
    """In a Hugging Face cache snapshot, an LFS file links to ``blobs/<sha256>``: the name is the oid
    the Hub gave the file, so the bytes must hash to it (huggingface_hub never re-checks a blob)."""
    path = ctx.root / name
    if ctx.allowed == os.path.realpath(ctx.root) or not os.path.islink(path):
        return
    blob = os.path.basename(os.path.realpath(path))
    if SHA256_NAME.fullmatch(blob) and blob != sha256:
        ctx.add("deep.blob_hash_mismatch", ERROR, ctx.disp(name),
                f"{name}: sha256 {sha256[:16]}... differs from its cache blob's name {blob[:16]}... (the LFS oid "
                "the Hub gave it): the cached file is corrupt", "delete the blob and download the file again "
                "(huggingface-cli download --force-download)", name=name, sha256=sha256, expected=blob)


def _compare(ctx: Context, name: str, sha256: str, manifest: dict[str, dict[str, Any]]) -> None:
    want = manifest[name]["sha256"] if name in manifest else None
    if want is not None and want != sha256:
        ctx.add("manifest.hash_mismatch", ERROR, ctx.disp(name),
                f"{name}: sha256 {sha256[:16]}... differs from the manifest's {str(want)[:16]}...",
                "the file is corrupt: copy it again or re-export", name=name, sha256=sha256, expected=want)
