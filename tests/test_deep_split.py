"""--deep's fast path (``scan_files``): one large file whose windows are scanned by both workers
gives the same findings and sha256 as one worker and as the reference, with NaN/Inf on the
elements on either side of every window boundary and tensors straddling the boundaries;
``check_bits_fast`` equals ``check_bits`` on every float format; the helping pool hands work over
only to an idle worker and stops on the first error. No torch here."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from ckptctl.format.header import read_header
from ckptctl.threads import Buffers, HelpingPool, Stopped
from ckptctl.verify.deep import DeepResult, _SharedScan, scan_file, scan_files
from ckptctl.verify.floatbits import FLOAT_BITS, TensorStats, check_bits, check_bits_fast
from tests.support import write_raw_safetensors as _write

SPECIALS = {  # (NaN pattern, +Inf pattern or None) as little-endian unsigned integers
    "F32": (0x7FC00001, 0x7F800000), "F16": (0x7E01, 0x7C00), "BF16": (0x7FC1, 0x7F80),
    "F64": (0x7FF8000000000001, 0x7FF0000000000000), "F8_E5M2": (0x7E, 0x7C), "F8_E4M3": (0x7F, None),
}


def _uint(dtype: str) -> np.dtype:
    return np.dtype(f"<u{FLOAT_BITS[dtype].bits // 8}")


def _cuts(path: Path, window: int) -> list[int]:
    """The window boundaries the fast path uses for ``path`` (as _SharedScan.run walks it)."""
    s = _SharedScan((str(path), str(path), read_header(path), 0), window, check_bits_fast)
    size, pos, out = path.stat().st_size, 0, []
    while pos < size:
        pos = s.cut(pos, min(pos + window, size))
        out.append(pos)
    return out


@pytest.fixture(scope="module")
def split_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """About 3 MB: large float tensors of every format at unaligned offsets (odd U8 pads between),
    with NaN, +Inf and -Inf on the element just before and just after every window boundary (4 KiB
    windows) that falls inside them, one all-zero matrix straddling boundaries, one tensor that is
    zero but for one value just after a boundary."""
    window = 4096
    rng = np.random.default_rng(7)
    plan = [("f32", "F32", (300, 513)), ("pad1", "U8", (3,)), ("bf16", "BF16", (257, 1031)),
            ("pad2", "U8", (5,)), ("f16", "F16", (129, 1023)), ("pad3", "U8", (1,)), ("f64", "F64", (97, 301)),
            ("pad4", "U8", (7,)), ("e5m2", "F8_E5M2", (61, 1001)), ("e4m3", "F8_E4M3", (59, 999)),
            ("pad5", "U8", (2,)), ("zero", "BF16", (33, 311)), ("onebit", "F32", (17, 613))]
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape in plan:
        if dtype == "U8":
            arrays[name] = np.full(shape, 0xFF, np.uint8)
        elif name in ("zero", "onebit"):
            arrays[name] = np.zeros(shape, _uint(dtype)) | (1 << (FLOAT_BITS[dtype].bits - 1))  # -0.0
        else:  # small finite values: random mantissa and sign, an exponent well below all ones
            bits = FLOAT_BITS[dtype].bits
            u = rng.integers(0, 1 << min(bits, 62), size=shape, dtype=np.uint64) if bits == 64 else \
                rng.integers(0, 1 << bits, size=shape, dtype=np.uint64)
            fb = FLOAT_BITS[dtype]
            mask = fb.exp if fb.exp else 0x78  # e4m3fn: keep the exponent below 1111
            arrays[name] = (u & ~np.uint64(mask | (fb.exp >> 1 if fb.exp else 0))).astype(_uint(dtype))
    path = tmp_path_factory.mktemp("split") / "one.safetensors"
    _write(path, [(n, d, s, arrays[n].tobytes()) for n, d, s in plan])
    hdr = read_header(path)
    assert hdr.ok
    cuts = _cuts(path, window)
    placed = 0
    straddled = set()
    for cut in cuts[:-1]:
        for t in hdr.tensors.values():
            b, e = hdr.data_start + t.begin, hdr.data_start + t.end
            if t.dtype == "U8" or not b < cut < e:
                continue
            straddled.add(t.name)
            if t.name == "zero":
                continue
            flat = arrays[t.name].reshape(-1)
            k = FLOAT_BITS[t.dtype].bits // 8
            assert (cut - b) % k == 0, "a window ends inside an element"
            at = (cut - b) // k
            if t.name == "onebit":
                if not (flat & FLOAT_BITS[t.dtype].absmask).any():
                    flat[at] = 1  # the only nonzero value: just after a boundary
                continue
            nan, inf = SPECIALS[t.dtype]
            flat[at - 1] = nan
            flat[at] = inf if inf is not None else nan
            if inf is not None:
                flat[at + 1] = inf | (1 << (FLOAT_BITS[t.dtype].bits - 1))  # -Inf
            placed += 1
    assert {"f32", "bf16", "f16", "f64", "e5m2", "e4m3", "zero"} <= straddled
    assert placed > 100
    _write(path, [(n, d, s, arrays[n].tobytes()) for n, d, s in plan])
    assert _cuts(path, window) == cuts
    return path, window


def _want(path: Path) -> dict[str, tuple[int, int, bool]]:
    """(NaN, Inf, nonzero) of every float tensor, by numpy's own float types where it has them."""
    hdr = read_header(path)
    raw = path.read_bytes()
    out = {}
    for t in hdr.tensors.values():
        if t.dtype == "U8":
            continue
        u = np.frombuffer(raw, _uint(t.dtype), t.numel, hdr.data_start + t.begin)
        fb = FLOAT_BITS[t.dtype]
        if t.dtype in ("F32", "F16", "F64"):
            f = u.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[t.dtype])
            out[t.name] = (int(np.isnan(f).sum()), int(np.isinf(f).sum()), bool((f != 0).any()))
        else:
            mag = u & fb.absmask
            special = (mag >= fb.exp) if fb.exp else (mag == fb.nan_only)
            nan = int((special & ((u & fb.man) != 0)).sum()) if fb.exp else int(special.sum())
            out[t.name] = (nan, int(special.sum()) - nan, bool(mag.any()))
    return out


def _counts(res: DeepResult) -> dict[str, tuple[int, int, bool]]:
    got: dict[str, list] = {}
    for f in res.findings:
        if f.code in ("deep.nan", "deep.inf", "deep.all_zero"):
            g = got.setdefault(f.tensor, [0, 0, True])
            g[{"deep.nan": 0, "deep.inf": 1, "deep.all_zero": 2}[f.code]] = False if f.code == "deep.all_zero" \
                else f.details["count"]
    return {k: tuple(v) for k, v in got.items()}


def _as_dicts(res: DeepResult) -> list[dict]:
    return [f.__dict__ if hasattr(f, "__dict__") else f._asdict() for f in res.findings]


@pytest.mark.parametrize("check", [check_bits_fast, check_bits], ids=["fast-bits", "reference-bits"])
def test_one_file_split_across_both_workers_equals_one_worker_and_the_reference(split_file, check) -> None:
    path, window = split_file
    hdr = read_header(path)
    ref = scan_file(str(path), str(path), hdr, chunk_bytes=window)
    want = _want(path)
    for name, (nan, inf, nonzero) in want.items():
        got = _counts(ref).get(name, (0, 0, True))
        assert (got[0], got[1]) == (nan, inf), name
        assert got[2] == nonzero or name == "zero", name
    assert any(f.code == "deep.all_zero" and f.tensor == "zero" for f in ref.findings)
    assert not any(f.tensor == "onebit" for f in ref.findings)  # one nonzero value, just after a boundary
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert ref.sha256 == sha

    calls: dict[int, int] = {}
    for workers in (1, 2):
        scanned_by: dict[str, int] = {}
        lock = threading.Lock()

        def recording(fb, buf, st) -> None:
            with lock:
                name = threading.current_thread().name
                scanned_by[name] = scanned_by.get(name, 0) + 1
            check(fb, buf, st)

        pool = HelpingPool(workers)
        s = _SharedScan((str(path), str(path), hdr, 0), window, recording)
        pool.run(lambda job: job.run(pool, None), [s])
        res = scan_files([(str(path), str(path), hdr, 0)], chunk_bytes=window, workers=workers)[0]
        assert isinstance(res, DeepResult)
        assert (res.sha256, res.bytes_read) == (sha, path.stat().st_size)
        assert _as_dicts(res) == _as_dicts(ref), workers
        assert s.outcome.sha256 == sha
        from ckptctl.verify.deep import _findings
        assert [f.__dict__ for f in _findings(str(path), s.plan, s.scanners, hdr)] == _as_dicts(ref)
        # the same checks made whoever made them: which worker took which window is the scheduler's choice
        assert 1 <= len(scanned_by) <= workers, scanned_by
        calls[workers] = sum(scanned_by.values())
    assert calls[1] == calls[2] > 1, calls


def test_several_files_of_uneven_sizes_in_order(tmp_path: Path, split_file) -> None:
    """A large file between small ones, a missing one and a non-safetensors one: results in the
    given order, the same on both paths."""
    big, window = split_file
    small = tmp_path / "small.safetensors"
    _write(small, [("w", "BF16", (4, 4), np.full(16, 0x7FC0, "<u2").tobytes())])
    other = tmp_path / "notes.txt"
    other.write_bytes(b"hello")
    files = [(str(small), "small", read_header(small), 0), (str(big), "big", read_header(big), 0),
             (str(tmp_path / "gone.safetensors"), "gone", None, 0), (str(other), "notes", None, 5)]
    runs = [scan_files(files, chunk_bytes=window, fast=fast, workers=w) for fast, w in ((False, 2), (True, 1), (True, 2))]
    for got in runs:
        assert [type(r).__name__ for r in got] == ["DeepResult", "DeepResult", "FileNotFoundError", "DeepResult"]
        assert [_as_dicts(r) for r in got if isinstance(r, DeepResult)] == \
            [_as_dicts(r) for r in runs[0] if isinstance(r, DeepResult)]
        assert [r.sha256 for r in got if isinstance(r, DeepResult)] == \
            [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p, *_ in (files[0], files[1], files[3])]
    assert _counts(runs[0][0]) == {"w": (16, 0, True)}


def test_progress_reports_every_byte_once(split_file) -> None:
    path, window = split_file
    hdr = read_header(path)
    for fast in (True, False):
        events: list[tuple[str, str, int]] = []
        scan_files([(str(path), "one", hdr, 123)], chunk_bytes=window, fast=fast,
                   progress=lambda *e: events.append(e))
        assert events[0] == ("file", "one", 123) and events[-1] == ("done", "one", 0)
        assert sum(n for ev, _, n in events if ev == "bytes") == path.stat().st_size


@pytest.mark.parametrize("dtype", sorted(FLOAT_BITS))
def test_check_bits_fast_equals_the_reference(dtype: str) -> None:
    fb = FLOAT_BITS[dtype]
    rng = np.random.default_rng(hash(dtype) % 1000)
    k = fb.bits // 8
    u = np.dtype(f"<u{k}")
    top = (1 << fb.bits) - 1
    cases = [np.zeros(5, u), np.zeros(5, u) | (1 << (fb.bits - 1)), np.array([fb.absmask], u), np.array([top], u),
             np.array([1 << (fb.bits - 1) | 1], u), np.array([1], u), np.array([0x80 if k == 1 else 1], u)]
    for n in (1, 2, 7, 64, 1000):
        r = rng.integers(0, top, size=n, endpoint=True, dtype=np.uint64).astype(u)
        cases += [r, r & ~np.array(fb.exp, u) if fb.exp else r, r | (1 << (fb.bits - 1)), r & (fb.absmask >> 1)]
    specials = [fb.exp, fb.exp | 1, fb.exp | fb.man] if fb.exp else [fb.nan_only or 0x80, 0x80, 0x7F, 0xFF]
    for sp in specials:
        base = rng.integers(0, 4, size=33, dtype=np.uint64).astype(u)
        for at in (0, 16, 32):
            c = base.copy()
            c[at] = sp
            cases += [c, c | (1 << (fb.bits - 1))]
    for c in cases:
        want, got = TensorStats(), TensorStats()
        check_bits(fb, c.tobytes(), want)
        check_bits_fast(fb, c.tobytes(), got)
        assert got == want, (dtype, c)
        primed = TensorStats(nonzero=True)  # once nonzero, it stays so on both
        check_bits_fast(fb, c.tobytes(), primed)
        assert primed.nonzero and (primed.nan, primed.inf) == (want.nan, want.inf)


def test_helping_pool_hands_over_only_to_a_worker_without_a_job_and_keeps_order_free() -> None:
    ran: list[tuple[str, int]] = []
    idle = threading.Event()

    def job(i: int) -> None:
        if i == 0:  # the long job: offers until the other worker, out of jobs, takes its tasks
            offered = 0
            while offered < 20:
                if pool.offer(lambda k=offered: ran.append((threading.current_thread().name, k))):
                    offered += 1
                    idle.set()
        # job 1 is short: its worker runs out of jobs and helps

    pool = HelpingPool(2)
    pool.run(job, [0, 1])
    assert idle.is_set() and sorted(k for _, k in ran) == list(range(20))
    one = HelpingPool(1)
    assert not one.offer(lambda: None)  # nobody is idle
    one.run(lambda i: ran.append(("solo", i)) if not one.offer(lambda: None) else None, [1])
    assert ("solo", 1) in ran


def test_helping_pool_stops_on_the_first_error() -> None:
    seen: list[int] = []

    def job(i: int) -> None:
        if i == 1:
            raise ValueError("boom")
        if pool.stop.wait(120):  # every other job waits for the stop the error sets, however late it comes
            raise Stopped
        seen.append(i)

    pool = HelpingPool(2)
    with pytest.raises(ValueError, match="boom"):
        pool.run(job, list(range(6)))
    assert pool.stop.is_set() and seen == []


def test_buffers_never_more_than_most() -> None:
    b = Buffers(16, 2)
    x, y = b.take(), b.take()
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        b.take(stop)
    b.give(x)
    assert b.take() is x and len(y) == 16
