"""Filling the planned shards of a staged version: each created and written (or linked from an
unchanged file), fsynced on a background thread while the next is written, hashed for the
manifest while written. :class:`~ckptctl.write.job.ExportJob` runs it as its write step."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ckptctl import _faults
from ckptctl.errors import from_oserror
from ckptctl.plan import Locate, Plan
from ckptctl.threads import WORKERS
from ckptctl.write.digest import ShardDigest
from ckptctl.write.files import fsync_and_close, link_or_copy
from ckptctl.write.inputs import Entry
from ckptctl.write.options import ExportOptions, ProgressEvent
from ckptctl.write.result import ExportResult
from ckptctl.write.shards import TensorWriter, write_shard


def fill_shards(plan: Plan, by_name: dict[str, Entry], data: Path, opts: ExportOptions, *, result: ExportResult,
                locate: Callable[[], Locate], allocate: bool, digests: dict[str, tuple[int, Any]],
                stop: threading.Event) -> None:
    """Create and fill (or link) every shard of ``plan`` in ``data``. Each written shard is
    fsynced on a background thread while the next one is written; every fsync has finished (and
    any error raised) on return. With ``opts.manifest`` each shard's digest is computed beside
    (``digests``: name -> (size, future)); ``stop`` set (the job failed) stops them at their next
    chunk. The bytes cloned, copied and streamed are added to ``result``."""
    tw = TensorWriter(opts.chunk_bytes, hashing=opts.manifest, allocate=allocate, writeback=opts.fsync)
    progress = opts.progress
    done, total = 0, plan.total_size

    def wrote(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(ProgressEvent("write", shard.name, done, total))

    syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-fsync")
    hasher = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckptctl-hash")  # two shards at once
    hashing: list[ShardDigest] = []
    pending = []
    try:
        for shard in plan.shards:
            _faults.point("shard-start")
            try:
                if shard.link_from:
                    tw.count(link_or_copy(Path(shard.link_from), data / shard.name, fsync=opts.fsync,
                                          link=opts.link_unchanged), shard.file_size)
                    done += shard.data_bytes
                else:
                    fd = write_shard(data / shard.name, shard, by_name, tw, on_tensor=wrote, locate=locate())
                    digest, tw.digest = tw.digest, None
                    try:
                        _faults.point("fsync-shard")
                    except BaseException:
                        os.close(fd)
                        if digest is not None:
                            digest.close()
                        raise
                    if digest is not None:  # reads back what the kernel copied, beside the fsync
                        hashing.append(digest)
                        digests[shard.name] = (shard.file_size, hasher.submit(digest.finish, shard.file_size, stop))
                    if opts.fsync:
                        pending.append((shard.name, syncer.submit(fsync_and_close, fd)))
                    else:
                        os.close(fd)
            except OSError as exc:
                raise from_oserror(exc, f"cannot write {shard.name}", phase="write") from None
            if progress:
                progress(ProgressEvent("shard-done", shard.name, done, total,
                                       message="linked" if shard.link_from else "wrote"))
        for name, fut in pending:
            try:
                fut.result()  # never retried: a failed fsync aborts the publish
            except OSError as exc:
                raise from_oserror(exc, f"cannot make {name} durable", phase="write") from None
    except BaseException:
        stop.set()
        hasher.shutdown(wait=True, cancel_futures=True)
        for digest in hashing:
            digest.close()  # those never started keep their descriptor until here
        raise
    finally:
        syncer.shutdown(wait=True)
        hasher.shutdown(wait=False)  # the digests finish on their own; finalize waits for them
        tw.close()
        result.bytes_cloned += tw.cloned
        result.bytes_copied_by_kernel += tw.copied
        result.bytes_streamed += tw.streamed
    _faults.point("shards-written")
