"""Crash harness: kill ``export --overwrite`` / ``resave`` at every phase and at random moments,
then prove the invariants of DESIGN.md section 1 on what is left.

Shared by the fast campaign in ``tests/test_crash_campaign.py`` and the long mode in
``bench/crash_campaign.py`` (hundreds of kills). Nothing is mocked: the command runs in a real
process that is SIGKILLed (by itself at a named fault point, ``CKPTCTL_KILL_AT``, or by us after a
random delay), on the real filesystem, with fsync on.

One trial (:func:`run_trial`):

1. a fresh workspace from the scenario's template: ``src/`` (export only) and ``ws/`` holding the
   destination ``ws/ckpt`` (the *old* version: weights, config.json, README.md, usually a
   manifest), a bystander checkpoint ``ws/other`` and a foreign ``_tmp_`` directory without an owner
   record (``ws/_tmp_ckpt.0000000000000001-00000000``, what another tool could leave; gc-tmp must
   keep it);
2. the command, killed at the fault;
3. **I1**: ``ws/ckpt`` is byte for byte the old version or the new one (the new one = what a clean
   run of the same command produces, manifest compared without its ``created`` stamp); the version
   found verifies clean (``ckptctl.verify``) and three loaders (glob, index-first, single-first) all
   load exactly its tensors. Only the exchange-less fallback has a window with no destination;
   then ``ready``/``old/`` must be there for gc-tmp to roll it forward or back;
   **I2**: a manifest lists every file with its exact size and sha256, and the index's
   ``weight_map`` equals the union of the shard headers;
4. **I4**: every leftover is a staging directory attributable to this destination (name + owner
   record); ``gc-tmp ws --min-age 0`` removes all of them and changes nothing else in ``ws``
   (or, in ``recovery="rerun"`` trials, the next run of the command cleans them up itself);
5. **I8**: the same command again exits 0 and leaves bytes identical to the clean run.

The outcome of each trial is a :class:`Outcome`; ``violations`` is empty when every check held.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/crash_campaign.py imports this module by path
    sys.path.insert(0, str(REPO))

MANIFEST = "ckptctl.manifest.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEST = "ckpt"
DECOY = "_tmp_ckpt.0000000000000001-00000000"  # matches the staging name pattern, no owner record
RUN_TIMEOUT = 300.0

# Every named fault point, in the order a publish reaches them (docs/ARCHITECTURE.md).
ALL_POINTS = ["stage-create", "stage-created", "shard-start", "write-data", "write-chunk", "fsync-shard",
              "shards-written", "index", "extras-written", "manifest-written", "fsync-dir", "sealed",
              "publish", "rename-noreplace", "exchange", "two-rename-between", "published", "after-publish"]
# after these the new version is visible
PUBLISHED_POINTS = {"published", "after-publish"}


# ----------------------------------------------------------------------------------------------
# Running ckptctl in a real process


@dataclass
class Result:
    rc: int  # negative: killed by that signal (as subprocess reports it)
    stdout: str
    stderr: str
    seconds: float


def _clean_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTCTL_")}
    env.update(extra or {})
    return env


def drop_dac_caps() -> None:
    """preexec_fn: as root, lose CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER across the
    exec that follows, so file permissions apply to the (uid 0) command like to any owner."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")


class ExecHandle:
    def __init__(self, argv: list[str], env: dict[str, str] | None, cwd: str | None, drop_dac: bool) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptctl", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     env=_clean_env(env), cwd=cwd,
                                     preexec_fn=drop_dac_caps if drop_dac and os.geteuid() == 0 else None)
        self.pid = self.proc.pid

    def wait(self, timeout: float = RUN_TIMEOUT) -> Result:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise TimeoutError(f"ckptctl did not finish within {timeout}s (killed): {err[-2000:]}") from None
        return Result(self.proc.returncode, out, err, time.monotonic() - self.started)


class ExecRunner:
    """``python -m ckptctl ARGS`` in a fresh interpreter (the most faithful, the slowest)."""

    name = "exec"

    def start(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              drop_dac: bool = False) -> ExecHandle:
        return ExecHandle([str(a) for a in argv], env, cwd, drop_dac)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT,
            cwd: str | None = None, drop_dac: bool = False) -> Result:
        return self.start(argv, env, cwd, drop_dac).wait(timeout)

    def close(self) -> None:
        pass


_ZYGOTE = r"""
import json, os, signal, sys, traceback
proto_in = os.fdopen(int(sys.argv[1]), "r")
proto_out = os.fdopen(int(sys.argv[2]), "w")
# what a ckptctl run imports, loaded once; the children are forked from here
import torch, safetensors, safetensors.torch, numpy
import ckptctl.cli, ckptctl.api, ckptctl.resave, ckptctl.writer, ckptctl.publish, ckptctl.gc
import ckptctl.verify, ckptctl.sources.safetensors_source, ckptctl.sources.torch_source
import ckptctl.cli.export_cmd, ckptctl.cli.resave_cmd, ckptctl.cli.gc_cmd, ckptctl.cli.verify_cmd
proto_out.write(json.dumps({"ready": os.getpid()}) + "\n"); proto_out.flush()
for line in proto_in:
    req = json.loads(line)
    if req["op"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto_out.write(json.dumps({"pid": req["pid"], "rc": rc}) + "\n"); proto_out.flush()
        continue
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            proto_in.close(); proto_out.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.dup2(f, fd); os.close(f)
            if req.get("cwd"):
                os.chdir(req["cwd"])
            os.environ.clear(); os.environ.update(req["env"])
            if req.get("drop_dac"):
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
                # capset(2): keep every capability but DAC_OVERRIDE, DAC_READ_SEARCH, FOWNER
                hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
                data = (ctypes.c_uint32 * 6)()
                if libc.capget(hdr, data) != 0:
                    raise OSError(ctypes.get_errno(), "capget")
                mask = ~((1 << 1) | (1 << 2) | (1 << 3)) & 0xFFFFFFFF
                data[0] &= mask; data[1] &= mask
                if libc.capset(hdr, data) != 0:
                    raise OSError(ctypes.get_errno(), "capset")
            sys.argv = ["ckptctl", *req["argv"]]
            code = 0
            try:
                ckptctl.cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    proto_out.write(json.dumps({"pid": pid}) + "\n"); proto_out.flush()
"""


class ZygoteHandle:
    def __init__(self, zygote: "ZygoteRunner", pid: int, out: str, err: str) -> None:
        self.zygote, self.pid, self.out, self.err = zygote, pid, out, err
        self.started = time.monotonic()

    def wait(self, timeout: float = RUN_TIMEOUT) -> Result:
        z = self.zygote
        z._send({"op": "wait", "pid": self.pid})
        reply = z._recv(timeout)
        timed_out = reply is None
        if timed_out:
            os.kill(self.pid, signal.SIGKILL)
            reply = z._recv(60)
        assert reply is not None and reply["pid"] == self.pid, reply
        texts = []
        for p in (self.out, self.err):  # absent when the child was killed before it opened them
            try:
                texts.append(Path(p).read_text(errors="replace"))
                os.unlink(p)
            except FileNotFoundError:
                texts.append("")
        res = Result(reply["rc"], texts[0], texts[1], time.monotonic() - self.started)
        if timed_out:
            raise TimeoutError(f"ckptctl did not finish within {timeout}s (killed): {res.stderr[-2000:]}")
        return res


class ZygoteRunner:
    """Forks each ``ckptctl`` process from a warm interpreter that has already imported torch and
    ckptctl: the child runs exactly ``ckptctl.cli.main()`` with its own argv, environment, stdout
    and stderr, is a real process (own pid, killed for real), and skips the ~2 s torch import.
    One request at a time is waited for; start several before waiting (second-writer tests)."""

    name = "zygote"

    def __init__(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="ckptctl-zygote-")
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(r_req), str(w_rep)],
                                     pass_fds=(r_req, w_rep), env=_clean_env(None), cwd=str(REPO),
                                     stdin=subprocess.DEVNULL)
        os.close(r_req)
        os.close(w_rep)
        self._w = os.fdopen(w_req, "w")
        self._r = r_rep
        self._buf = b""
        self._n = 0
        ready = self._recv(120)
        if ready is None or "ready" not in ready:
            raise RuntimeError("zygote did not start")

    def _send(self, doc: dict) -> None:
        self._w.write(json.dumps(doc) + "\n")
        self._w.flush()

    def _recv(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 65536)
                if not chunk:
                    raise RuntimeError("zygote died")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              drop_dac: bool = False) -> ZygoteHandle:
        self._n += 1
        out = os.path.join(self._tmp, f"{self._n}.out")
        err = os.path.join(self._tmp, f"{self._n}.err")
        self._send({"op": "spawn", "argv": [str(a) for a in argv], "env": _clean_env(env), "cwd": cwd,
                    "out": out, "err": err, "drop_dac": drop_dac})
        reply = self._recv(60)
        assert reply is not None and "pid" in reply, reply
        return ZygoteHandle(self, reply["pid"], out, err)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT,
            cwd: str | None = None, drop_dac: bool = False) -> Result:
        return self.start(argv, env, cwd, drop_dac).wait(timeout)

    def close(self) -> None:
        try:
            self._w.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._r)
        shutil.rmtree(self._tmp, ignore_errors=True)


def wait_stopped(pid: int, timeout: float = 120) -> None:
    """Wait until ``pid`` is stopped (SIGSTOP at a CKPTCTL_STOP_AT point)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            raise AssertionError(f"process {pid} exited instead of stopping") from None
        st = stat[stat.rfind(")") + 2]
        if st == "T":
            return
        if st == "Z":
            raise AssertionError(f"process {pid} exited instead of stopping")
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout}s")


# ----------------------------------------------------------------------------------------------
# Looking at directories


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_DIGESTS: dict[tuple, str] = {}


def _file_digest(path: Path) -> str:
    """sha256 of a file's bytes; remembered per (device, inode, size, mtime, ctime), so a file that
    did not change is hashed once however many snapshots include it."""
    st = os.lstat(path)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    got = _DIGESTS.get(ident)
    if got is None:
        got = _file_digest_uncached(path)
        if len(_DIGESTS) > 100_000:
            _DIGESTS.clear()
        _DIGESTS[ident] = got
    return got


def _file_digest_uncached(path: Path) -> str:
    data = path.read_bytes()
    if path.name == MANIFEST:
        try:
            doc = json.loads(data)
            doc.pop("created", None)  # the one field that differs between two clean runs
            return "manifest:" + _sha(json.dumps(doc, sort_keys=True).encode())
        except ValueError:
            pass
    return _sha(data)


def snapshot(root: Path, skip: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Every entry below ``root`` (links not followed): 'dir', 'link:<target>' or a content digest
    (a manifest's without its ``created`` stamp). ``skip(relpath)`` prunes entries."""
    out: dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for n in sorted(dirs + files):
            rel = n if rel_dir == "." else f"{rel_dir}/{n}"
            if skip and skip(rel):
                if n in dirs:
                    dirs.remove(n)
                continue
            p = Path(dirpath) / n
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
                if n in dirs:
                    dirs.remove(n)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = _file_digest(p)
    return out


def our_staging(ws: Path) -> list[Path]:
    """Entries of ``ws`` that look like staging (``_tmp_*``), except the foreign decoy."""
    return sorted(p for p in ws.iterdir() if p.name.startswith("_tmp_") and p.name != DECOY)


def _is_stub(d: Path) -> bool:
    """Nothing inside but empty ``lock``/``owner.json`` (gc-tmp's definition of a stub)."""
    try:
        names = os.listdir(d)
        return set(names) <= {"lock", "owner.json"} and all(
            (d / n).is_file() and not (d / n).is_symlink() and (d / n).stat().st_size == 0 for n in names)
    except OSError:
        return False


def attributable(d: Path, dest_name: str = DEST) -> str | None:
    """Why ``d`` is not an attributable staging directory of ``dest_name`` (None when it is)."""
    from ckptctl import staging

    parsed = staging.parse_name(d.name)
    if not parsed or parsed[0] != dest_name:
        return f"{d.name}: not a staging name for {dest_name}"
    if not d.is_dir() or d.is_symlink():
        return f"{d.name}: not a directory"
    owner = staging.read_owner(d)
    if owner is None:
        # an empty stub (killed between mkdir and the owner record, or at the end of the cleanup)
        # is recognised by gc-tmp too
        return None if _is_stub(d) else f"{d.name}: no owner record"
    if owner.get("dest") != dest_name:
        return f"{d.name}: owner record names {owner.get('dest')!r}"
    return None


def infer_phase(ws: Path) -> str:
    """Where a randomly killed writer was, judged from what it left."""
    st = our_staging(ws)
    if not st:
        return "before-staging-or-done"
    d = st[-1]
    names = set(os.listdir(d))
    if "old" in names:
        return "two-rename"
    if "ready" in names:
        return "sealed"
    if "data" not in names:
        return "staging"
    data = set(os.listdir(d / "data"))
    if not os.path.lexists(ws / DEST) or "owner.json" not in names:
        return "cleanup"
    if MANIFEST in data or INDEX in data or "config.json" in data:
        return "finalize"
    if any(n.endswith(".safetensors") for n in data):
        return "writing"
    return "staged"


# ---- tensors, three ways of loading -----------------------------------------------------------


def load_glob(d: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in out:
                raise ValueError(f"{k} in two files")
            out[k] = v
    return out


def load_index_first(d: Path) -> dict:
    """huggingface_hub's rule: the index when there is one, else model.safetensors."""
    from safetensors.torch import load_file

    if (d / INDEX).exists():
        wm = json.loads((d / INDEX).read_text())["weight_map"]
        out: dict = {}
        for f in sorted(set(wm.values())):
            out.update(load_file(str(d / f)))
        if set(out) != set(wm):
            raise ValueError("index and shards disagree")
        return out
    return load_file(str(d / SINGLE))


def load_single_first(d: Path) -> dict:
    """transformers' rule: model.safetensors when there is one, else the index."""
    from safetensors.torch import load_file

    if (d / SINGLE).exists():
        return load_file(str(d / SINGLE))
    return load_index_first(d)


LOADERS = {"glob": load_glob, "index-first": load_index_first, "single-first": load_single_first}


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def check_version(d: Path, expected: dict) -> list[str]:
    """I1 for a version that must be clean: verify finds no error; every loader sees ``expected``."""
    from ckptctl.findings import ERROR
    from ckptctl.verify import verify_path

    problems = []
    res = verify_path(d)
    errors = [f"{f.code}: {f.message}" for f in res.findings if f.severity == ERROR]
    if errors:
        problems.append(f"verify: {errors[:3]}")
    for name, loader in LOADERS.items():
        try:
            got = loader(d)
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"{name} loader failed: {type(exc).__name__}: {exc}")
            continue
        if not same_tensors(got, expected):
            problems.append(f"{name} loader sees different tensors")
    return problems


def check_marker(d: Path) -> list[str]:
    """I2: the manifest (if any) lists every file with its exact size and sha256, and nothing is
    unlisted; the index's weight_map equals the union of the shard headers."""
    problems = []
    m = d / MANIFEST
    if m.exists():
        doc = json.loads(m.read_bytes())
        files = doc["files"]
        for name, e in files.items():
            p = d / name
            if not p.is_file():
                problems.append(f"manifest lists {name}, which does not exist")
                continue
            if p.stat().st_size != e["size"]:
                problems.append(f"manifest size of {name} is wrong")
            elif _sha(p.read_bytes()) != e["sha256"]:
                problems.append(f"manifest sha256 of {name} is wrong")
        present = {os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs} - {MANIFEST}
        if present != set(files):
            problems.append(f"manifest does not list {sorted(present - set(files))} / lists extra "
                            f"{sorted(set(files) - present)}")
    if (d / INDEX).exists():
        wm = json.loads((d / INDEX).read_text())["weight_map"]
        union: dict[str, str] = {}
        for shard in sorted(set(wm.values())):
            for name in header_names(d / shard):
                union[name] = shard
        if union != wm:
            problems.append("index weight_map differs from the union of the shard headers")
    return problems


def header_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    return [k for k in hdr if k != "__metadata__"]


# ---- a reader polling the destination during publishes --------------------------------------


class ViewError(Exception):
    pass


Opener = Callable[[str], int]  # file name -> an open read-only descriptor
_SIG_CACHE: dict[tuple, dict[str, str]] = {}


def _read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 1 << 22)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _tensor_sigs(open_file: Opener, name: str) -> dict[str, str]:
    """Tensor name -> dtype, shape and a digest of its bytes, from one safetensors file. An
    unchanged file (same inode, size, mtime and ctime) is hashed once."""
    fd = open_file(name)
    try:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if ident in _SIG_CACHE:
            return _SIG_CACHE[ident]
        raw = _read_fd(fd)
    finally:
        os.close(fd)
    if len(raw) < 8:
        raise ViewError(f"{name}: too short")
    n = struct.unpack("<Q", raw[:8])[0]
    if 8 + n > len(raw):
        raise ViewError(f"{name}: header longer than file")
    hdr = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        if base + e > len(raw):
            raise ViewError(f"{name}: truncated")
        out[k] = f"{v['dtype']}{v['shape']}{_sha(raw[base + b:base + e])}"
    if len(_SIG_CACHE) > 10_000:
        _SIG_CACHE.clear()
    _SIG_CACHE[ident] = out
    return out


def view_signature(names: list[str], open_file: Opener) -> tuple[str, str, str]:
    """(glob, index-first, single-first): what each loader would load from a directory view, as a
    digest of tensor names, dtypes, shapes and bytes; 'error:...' where it could not."""

    def digest(sigs: dict[str, str]) -> str:
        return _sha(json.dumps(sorted(sigs.items())).encode())[:16]

    def files(fs: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fs:
            for k, v in _tensor_sigs(open_file, f).items():
                if k in out:
                    raise ViewError(f"{k} twice")
                out[k] = v
        return out

    def via_index() -> dict[str, str]:
        fd = open_file(INDEX)
        try:
            wm = json.loads(_read_fd(fd))["weight_map"]
        finally:
            os.close(fd)
        got = files(sorted(set(wm.values())))
        if set(got) != set(wm):
            raise ViewError("index names tensors its shards do not hold")
        return got

    result = []
    for how in ("glob", "index-first", "single-first"):
        try:
            if how == "glob":
                sigs = files(sorted(n for n in names if n.endswith(".safetensors")))
            elif how == "index-first":
                sigs = via_index() if INDEX in names else files([SINGLE])
            else:
                sigs = files([SINGLE]) if SINGLE in names else via_index()
            result.append(digest(sigs))
        except FileNotFoundError as exc:
            result.append(f"error:missing {os.path.basename(str(exc.filename))}")
        except (ViewError, ValueError, KeyError, OSError) as exc:
            result.append(f"error:{type(exc).__name__}")
    return tuple(result)  # type: ignore[return-value]


def dir_signature(d: Path) -> tuple[str, str, str]:
    """The loaders' view of ``d``, each file opened by its path (as transformers does)."""
    return view_signature(sorted(os.listdir(d)), lambda n: os.open(d / n, os.O_RDONLY | os.O_CLOEXEC))


@dataclass
class PollStats:
    observations: int = 0  # consistent views of the destination (old or new)
    old: int = 0
    new: int = 0
    absent: int = 0  # no destination at all (only the exchange-less fallback may cause this)
    superseded: int = 0  # the directory we read was replaced while we read it: read again
    violations: list[str] = field(default_factory=list)
    path_straddled: int = 0  # path-based reads that crossed a publish (informational)
    path_mixed_across_publish: int = 0  # ... and saw a mix: what a path-by-path loader risks


class Poller:
    """A thread that reads the destination as fast as it can while a writer publishes.

    Each read opens the directory once and reads the index and shards relative to that descriptor
    (``openat``), like a reader holding on to one version; afterwards it checks that the
    destination is still that directory. A read of a directory that stayed the destination must
    show, for every loader, exactly the old or the new version. Reads whose directory was
    superseded meanwhile are counted and retried. A second, path-by-path read (what transformers
    does: join paths for each file) is recorded separately: across a publish it can mix versions,
    which no directory-rename publish prevents; while the destination did not change it must not.
    """

    def __init__(self, dst: Path, versions: dict[str, tuple[str, str, str]], *, absent_ok: bool = False,
                 path_reads: bool = True) -> None:
        self.dst, self.versions, self.absent_ok, self.path_reads = dst, versions, absent_ok, path_reads
        self.stats = PollStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _classify(self, sig: tuple[str, str, str]) -> str | None:
        for name, v in self.versions.items():
            if sig == v:
                return name
        return None

    def _run(self) -> None:
        s = self.stats
        while not self._stop.is_set():
            try:
                dfd = os.open(self.dst, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                s.absent += 1
                if not self.absent_ok and len(s.violations) < 20:
                    s.violations.append("destination absent")
                continue
            except NotADirectoryError:
                s.violations.append("destination is not a directory")
                continue
            try:
                st0 = os.fstat(dfd)
                sig = view_signature(sorted(os.listdir(dfd)),
                                     lambda n: os.open(n, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd))
            finally:
                os.close(dfd)
            try:
                st1 = os.stat(self.dst)
                still = (st1.st_dev, st1.st_ino) == (st0.st_dev, st0.st_ino)
            except FileNotFoundError:
                still = False
            version = self._classify(sig)
            if not still:
                s.superseded += 1
            elif version is None:
                if len(s.violations) < 20:
                    s.violations.append(f"inconsistent view {sig}")
            else:
                s.observations += 1
                setattr(s, version, getattr(s, version) + 1)
            if self.path_reads:
                self._path_read()

    def _path_read(self) -> None:
        s = self.stats
        try:
            before = os.stat(self.dst).st_ino
            sig = dir_signature(self.dst)
            after = os.stat(self.dst).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return
        if before != after:
            s.path_straddled += 1
            if self._classify(sig) is None:
                s.path_mixed_across_publish += 1
        elif self._classify(sig) is None:
            s.violations.append(f"path-based read of an unchanged destination is inconsistent {sig}")


# ----------------------------------------------------------------------------------------------
# Scenarios


def _state(seed: int, n: int = 6, rows: int = 64, cols: int = 32):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.weight": torch.randn(rows, cols, generator=g) for i in range(n)}


def _save_single(d: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / SINGLE), metadata={"format": "pt"})


def _save_sharded(d: Path, tensors: dict, max_shard_size: int) -> None:
    """Sharded with huggingface_hub's own saver (an index and -0000k-of-0000n shards)."""
    from huggingface_hub import save_torch_state_dict

    d.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: v.clone() for k, v in tensors.items()}, d, max_shard_size=max_shard_size)


def _config(d: Path, dtype: str = "float32") -> None:
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": dtype}, indent=2) + "\n")


def _write_manifest(d: Path) -> None:
    """The old version's manifest, as an earlier `--manifest` run wrote it."""
    from ckptctl.manifest import build_manifest, encode_manifest

    files = sorted(os.path.relpath(os.path.join(dp, f), d) for dp, _, fs in os.walk(d) for f in fs)
    (d / MANIFEST).write_bytes(encode_manifest(build_manifest(d, files, label="old")))


def _fsync_tree(root: Path) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


@dataclass
class Scenario:
    """A destination's old version, maybe a source, and the command that replaces it."""

    name: str
    description: str
    build_old: Callable[[Path], None] | None  # None: the destination does not exist yet
    build_src: Callable[[Path], None] | None  # export only
    args: list[str]  # after the command name; {src} and {dst} are substituted
    points: list[str]  # the fault points this command reaches (a kill there must happen)
    old_clean: bool = True  # the old version verifies clean and the loaders agree on it
    env: dict[str, str] = field(default_factory=dict)  # e.g. force the exchange-less fallback
    big: bool = False  # sized for random kills during data writes
    # the retry: the same command, plus these (a retry of an export to a new destination that got
    # past its publish must say --overwrite, or it is refused with exit 2: see docs/RELIABILITY.md)
    rerun_extra: list[str] = field(default_factory=list)

    def argv(self, src: Path, dst: Path) -> list[str]:
        return [a.replace("{src}", str(src)).replace("{dst}", str(dst)) for a in self.args]


def _finish_old(d: Path) -> None:
    """What every "old version" has beside its weights: config, a model card, a manifest."""
    _config(d)
    (d / "README.md").write_text("old model card\n")
    _write_manifest(d)


def _old_sharded(d: Path) -> None:
    _save_sharded(d, _state(1), max_shard_size=20_000)
    _finish_old(d)


def _old_single(d: Path) -> None:
    _save_single(d, _state(1))
    _finish_old(d)


def _src_single(d: Path) -> None:
    _save_single(d, _state(2))
    _config(d)


def _src_sharded(d: Path) -> None:
    _save_sharded(d, _state(2), max_shard_size=20_000)
    _config(d)


def _old_needs_repair(d: Path) -> None:
    """What crashed tools leave: a wrong total_size, trailing bytes after a shard's data, a stale
    shard of another save beside the family, a safetensors temp file; no manifest."""
    _save_sharded(d, _state(1), max_shard_size=20_000)
    _config(d)
    (d / "README.md").write_text("old model card\n")
    idx = json.loads((d / INDEX).read_text())
    idx["metadata"]["total_size"] = 1
    (d / INDEX).write_text(json.dumps(idx, indent=2))
    with open(d / "model-00002-of-00003.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    shutil.copy(d / "model-00001-of-00003.safetensors", d / "model-00001-of-00004.safetensors")
    (d / ".tmpXyZ123").write_bytes(b"partial")


def _big(seed: int):
    return _state(seed, n=8, rows=1024, cols=1024)  # 8 x 4 MiB fp32


def _old_small_single(d: Path) -> None:
    _save_single(d, _state(1, n=2))
    _finish_old(d)


def _src_big(d: Path) -> None:
    _save_single(d, _big(3))
    _config(d)


def _old_big_single(d: Path) -> None:
    _save_single(d, _big(4))
    _finish_old(d)


def _old_big_sharded(d: Path) -> None:
    _save_sharded(d, _big(5), max_shard_size=9_000_000)
    _finish_old(d)


_COMMON = ["stage-create", "stage-created", "shard-start", "write-data", "fsync-shard", "shards-written",
           "extras-written", "manifest-written", "fsync-dir", "sealed", "publish", "exchange", "published",
           "after-publish"]
EINVAL = {"CKPTCTL_FAIL_AT": "exchange:EINVAL"}  # the filesystem cannot exchange: journaled two-rename
_FALLBACK_POINTS = ["sealed", "two-rename-between", "published", "after-publish"]

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("export-sharded-to-single", "export --overwrite: 3 shards + index -> one file (kernel copy)",
             _old_sharded, _src_single, ["export", "{src}", "{dst}", "--overwrite", "--manifest"], _COMMON),
    Scenario("export-single-to-sharded", "export --overwrite: one file -> 3 shards + index",
             _old_single, _src_sharded,
             ["export", "{src}", "{dst}", "--overwrite", "--manifest", "--max-shard-size", "20KB"],
             _COMMON[:6] + ["index"] + _COMMON[6:]),
    Scenario("export-new-destination", "export to a destination that does not exist yet",
             None, _src_sharded, ["export", "{src}", "{dst}", "--manifest", "--max-shard-size", "20KB"],
             ["stage-created", "write-data", "index", "sealed", "publish", "rename-noreplace", "published",
              "after-publish"], rerun_extra=["--overwrite"]),
    Scenario("export-two-rename", "export --overwrite where RENAME_EXCHANGE is refused (EINVAL, as on NFS)",
             _old_sharded, _src_single, ["export", "{src}", "{dst}", "--overwrite", "--manifest"],
             _FALLBACK_POINTS, env=EINVAL),
    Scenario("resave-dtype", "resave --dtype bf16 in place: 3 fp32 shards -> one bf16 file (streamed)",
             _old_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"],
             _COMMON[:4] + ["write-chunk"] + _COMMON[4:]),
    Scenario("resave-repair", "resave --repair in place: stale shard, temp file, trailing bytes, bad total",
             _old_needs_repair, None, ["resave", "{dst}", "--repair", "--manifest"],
             _COMMON[:6] + ["index"] + _COMMON[6:], old_clean=False),
    Scenario("resave-two-rename", "resave --dtype bf16 where RENAME_EXCHANGE is refused",
             _old_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"], _FALLBACK_POINTS,
             env=EINVAL),
    # sized for random kills while data is written (32 MiB of fp32)
    Scenario("big-export-bf16", "export --overwrite --dtype bf16 of 32 MiB into 4 MB shards (streamed)",
             _old_small_single, _src_big,
             ["export", "{src}", "{dst}", "--overwrite", "--dtype", "bf16", "--max-shard-size", "4MB",
              "--manifest"], ["write-chunk", "fsync-shard", "published"], big=True),
    Scenario("big-resave-reshard", "resave --max-shard-size 9MB of a 32 MiB single file (kernel copy)",
             _old_big_single, None, ["resave", "{dst}", "--max-shard-size", "9MB", "--manifest"],
             ["write-data", "fsync-shard", "published"], big=True),
    Scenario("big-resave-bf16", "resave --dtype bf16 of 32 MiB in 4 shards (streamed)",
             _old_big_sharded, None, ["resave", "{dst}", "--dtype", "bf16", "--manifest"],
             ["write-chunk", "fsync-shard", "published"], big=True),
    Scenario("big-export-two-rename", "big-export-bf16 where RENAME_EXCHANGE is refused",
             _old_small_single, _src_big,
             ["export", "{src}", "{dst}", "--overwrite", "--dtype", "bf16", "--max-shard-size", "4MB",
              "--manifest"], ["two-rename-between"], env=EINVAL, big=True),
]}


class Prepared:
    """A scenario's template (old destination, source) and its reference: what a clean run of the
    command produces, its tensors, and the poller signatures of both versions."""

    def __init__(self, scn: Scenario, root: Path, runner: Any) -> None:
        self.scn = scn
        self.root = root
        tpl = root / "template"
        (tpl / "ws").mkdir(parents=True)
        if scn.build_src:
            scn.build_src(tpl / "src")
        if scn.build_old:
            scn.build_old(tpl / "ws" / DEST)
        _save_single(tpl / "ws" / "other", _state(9, n=2))  # a bystander checkpoint
        (tpl / "ws" / "other" / "notes.txt").write_text("not ckptctl's\n")
        (tpl / "ws" / DECOY).mkdir()
        (tpl / "ws" / DECOY / "state.bin").write_bytes(b"another tool's staging\n")
        _fsync_tree(tpl)
        self.template = tpl
        self.old_snapshot = snapshot(tpl / "ws" / DEST)
        self.old_absent = scn.build_old is None
        self.old_tensors = load_index_first(tpl / "ws" / DEST) if scn.old_clean and not self.old_absent else None
        self.old_sig = dir_signature(tpl / "ws" / DEST) if not self.old_absent else None
        # the clean run
        ref = self.instantiate(root / "reference")
        env = {k: v for k, v in scn.env.items()}
        r = runner.run(scn.argv(ref.src, ref.dst), env=env)
        if r.rc != 0:
            raise RuntimeError(f"clean run of {scn.name} failed ({r.rc}): {r.stderr[-3000:]}")
        self.clean_seconds = r.seconds
        self.new_snapshot = snapshot(ref.dst)
        self.new_tensors = load_index_first(ref.dst)
        self.new_sig = dir_signature(ref.dst)
        problems = check_version(ref.dst, self.new_tensors) + check_marker(ref.dst)
        if problems:
            raise RuntimeError(f"clean run of {scn.name} is not clean: {problems}")
        if our_staging(ref.ws):
            raise RuntimeError(f"clean run of {scn.name} left staging behind")
        shutil.rmtree(ref.base)
        # how long a clean run lives after its staging directory appears: random kills aim there
        self.staged_seconds = self.clean_seconds
        if scn.big:
            spans = []
            for _ in range(3):
                ref = self.instantiate(root / "reference")
                h = runner.start(scn.argv(ref.src, ref.dst), env=dict(scn.env))
                _wait_for_staging(ref.ws, h.pid)
                t = time.monotonic()
                if h.wait().rc != 0:
                    raise RuntimeError(f"clean run of {scn.name} failed")
                spans.append(time.monotonic() - t)
                shutil.rmtree(ref.base)
            self.staged_seconds = sorted(spans)[1]

    @dataclass
    class Paths:
        base: Path
        src: Path
        ws: Path
        dst: Path

    def instantiate(self, base: Path) -> "Prepared.Paths":
        if base.exists():
            shutil.rmtree(base)
        shutil.copytree(self.template, base, symlinks=True)
        return Prepared.Paths(base, base / "src", base / "ws", base / "ws" / DEST)

    def versions(self) -> dict[str, tuple[str, str, str]]:
        out = {"new": self.new_sig}
        if self.old_sig is not None:
            out["old"] = self.old_sig
        return out


# ----------------------------------------------------------------------------------------------
# One trial


@dataclass
class Fault:
    kind: str  # "point" | "random"
    point: str | None = None
    delay: float | None = None  # random: seconds after the staging directory appeared
    env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.kind == "point":
            return f"kill at {self.point}"
        return "kill at a random moment"


@dataclass
class Outcome:
    scenario: str
    fault: str
    runner: str
    recovery: str  # "gc" (gc-tmp first, then the re-run) or "rerun" (the re-run cleans up alone)
    delay: float | None = None
    rc: int | None = None
    killed: bool = False
    phase: str | None = None  # random kills: where the writer was, judged from what it left
    after_kill: str = "?"  # old | new | window | lost | mixed
    after_recovery: str = "?"  # old | new after gc-tmp / the re-run's own recovery
    staging_left: int = 0  # staging directories the kill left
    gc_removed: int = 0
    leaked_after_gc: int = 0
    stubs_left_for_gc: int = 0  # recovery "rerun": empty stubs the re-run left for gc-tmp
    gc_touched_other: bool = False
    manifest_present: bool = False
    rerun_identical: bool = False
    poll: dict[str, Any] | None = None
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _classify(dst: Path, prep: Prepared) -> str:
    if not os.path.lexists(dst):
        return "absent"
    snap = snapshot(dst)
    if not prep.old_absent and snap == prep.old_snapshot:
        return "old"
    if snap == prep.new_snapshot:
        return "new"
    return "mixed"


def _diff(a: dict[str, str], b: dict[str, str]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: {a.get(k, '-')[:12]} -> {b.get(k, '-')[:12]}" for k in keys if a.get(k) != b.get(k))[:400]


def _check_state(state: str, dst: Path, prep: Prepared, out: Outcome, when: str) -> None:
    if state == "old":
        if prep.old_tensors is not None:
            out.violations += [f"{when}: old version: {p}" for p in check_version(dst, prep.old_tensors)]
            out.violations += [f"{when}: old version: {p}" for p in check_marker(dst)]
    elif state == "new":
        out.violations += [f"{when}: new version: {p}" for p in check_version(dst, prep.new_tensors)]
        out.violations += [f"{when}: new version: {p}" for p in check_marker(dst)]
    elif state == "mixed":
        base = prep.old_snapshot if not prep.old_absent else prep.new_snapshot
        out.violations.append(f"{when}: destination is neither the old nor the new version: "
                              f"{_diff(base, snapshot(dst))}")


def run_trial(prep: Prepared, fault: Fault, work: Path, runner: Any, *, recovery: str = "gc",
              poll: bool = False, keep: bool = False) -> Outcome:
    """One kill and every check after it. ``work`` is a scratch directory (replaced)."""
    scn = prep.scn
    t0 = time.monotonic()
    out = Outcome(scn.name, fault.label, runner.name, recovery, delay=fault.delay)
    p = prep.instantiate(work)
    argv = scn.argv(p.src, p.dst)
    bystanders = snapshot(p.ws, skip=lambda rel: rel == DEST or rel.startswith(DEST + "/"))
    src_before = snapshot(p.src)
    env = dict(scn.env)
    env.update(fault.env)
    if fault.kind == "point":
        env["CKPTCTL_KILL_AT"] = fault.point or ""
    poller = Poller(p.dst, prep.versions(), absent_ok="CKPTCTL_FAIL_AT" in env or prep.old_absent) if poll else None
    try:
        if poller:
            poller.__enter__()
        try:
            h = runner.start(argv, env=env)
            if fault.kind == "random":
                _wait_for_staging(p.ws, h.pid)
                time.sleep(fault.delay or 0)
                try:
                    os.kill(h.pid, signal.SIGKILL)  # not yet reaped: the pid is still ours
                except ProcessLookupError:
                    pass
            res = h.wait()
        finally:
            if poller:
                poller.__exit__(None, None, None)
        out.rc = res.rc
        out.killed = res.rc == -signal.SIGKILL
        if poller:
            out.poll = asdict(poller.stats)
            out.violations += [f"poller: {v}" for v in poller.stats.violations[:5]]
        if fault.kind == "point" and not out.killed:
            out.violations.append(f"the command did not reach {fault.point} (exit {res.rc}): {res.stderr[-500:]}")
        if not out.killed and res.rc != 0:
            out.violations.append(f"exit {res.rc}: {res.stderr[-500:]}")
        if fault.kind == "random":
            out.phase = infer_phase(p.ws) if out.killed else "completed"

        # --- I1 / I2 right after the kill
        leftovers = our_staging(p.ws)
        out.staging_left = len(leftovers)
        for d in leftovers:
            why = attributable(d)
            if why:
                out.violations.append(f"I4: unattributable leftover: {why}")
        state = _classify(p.dst, prep)
        if state == "absent":
            if prep.old_absent:
                state = "old"
            elif any((d / "old").is_dir() for d in leftovers):
                state = "window"  # exchange-less publish between its two renames: gc-tmp finishes it
            else:
                state = "lost"
                out.violations.append("I1: the destination is gone and nothing can bring it back")
        out.after_kill = state
        if out.phase == "before-staging-or-done":
            out.phase = "before staging" if state == "old" else "after cleanup"
        elif fault.kind == "random" and out.killed and state == "new":
            out.phase = "after publish"
        if state in ("old", "new", "mixed") and os.path.lexists(p.dst):
            _check_state(state, p.dst, prep, out, "after kill")
            out.manifest_present = (p.dst / MANIFEST).exists()
        if fault.kind == "point" and fault.point and state in ("old", "new"):
            expect_new = fault.point in PUBLISHED_POINTS
            if expect_new != (state == "new"):
                out.violations.append(f"I1: killed at {fault.point} but found the {state} version")

        # --- I4: gc-tmp removes every leftover and nothing else (or the re-run's own recovery)
        def rerun() -> None:
            r = runner.run(argv + scn.rerun_extra, env=dict(scn.env))
            if r.rc != 0:
                out.violations.append(f"I8: re-run failed ({r.rc}): {r.stderr[-500:]}")
                return
            snap = snapshot(p.dst)
            out.rerun_identical = snap == prep.new_snapshot
            if not out.rerun_identical:
                out.violations.append(f"I8: re-run differs from a clean run: {_diff(prep.new_snapshot, snap)}")
            # the re-run removes a dead writer's staging directory (recover_destination); an empty
            # stub (a kill during the last steps of the cleanup: owner record already gone) has
            # nothing to attribute, and is gc-tmp's (as a stub)
            left = [d for d in our_staging(p.ws) if not _is_stub(d)]
            out.stubs_left_for_gc = len(our_staging(p.ws)) - len(left)
            if left:
                out.violations.append(f"re-run left staging behind: {[d.name for d in left]}")

        def gc() -> None:
            before = snapshot(p.ws, skip=lambda rel: rel.split("/")[0] in {d.name for d in our_staging(p.ws)}
                              or (state == "window" and rel.split("/")[0] == DEST))
            r = runner.run(["gc-tmp", str(p.ws), "--min-age", "0", "--json"])
            if r.rc != 0:
                out.violations.append(f"I4: gc-tmp exited {r.rc}: {r.stderr[-500:]}")
                return
            doc = json.loads(r.stdout)
            out.gc_removed += doc["removed"]
            left = our_staging(p.ws)
            out.leaked_after_gc = len(left)
            if left:
                out.violations.append(f"I4: gc-tmp left {[d.name for d in left]}")
            after = snapshot(p.ws, skip=lambda rel: state == "window" and rel.split("/")[0] == DEST)
            if after != before:
                out.gc_touched_other = True
                out.violations.append(f"I4: gc-tmp changed something that is not staging: {_diff(before, after)}")

        if recovery == "gc":
            gc()
        else:
            rerun()
        if not our_staging(p.ws) or recovery == "rerun":
            st = _classify(p.dst, prep)
            if st == "absent" and prep.old_absent:
                st = "old"
            out.after_recovery = st
            if recovery == "gc":
                if st not in ("old", "new"):
                    out.violations.append(f"I1: after gc-tmp the destination is {st}")
                elif state in ("old", "new") and st != state:
                    out.violations.append(f"gc-tmp changed the destination from {state} to {st}")
                else:
                    _check_state(st, p.dst, prep, out, "after gc-tmp")
        if recovery == "gc":
            rerun()
        else:
            gc()  # nothing of ours may be left for it
        if recovery == "rerun" and out.gc_removed > out.stubs_left_for_gc:
            out.violations.append(f"the re-run left {out.gc_removed} staging directories for gc-tmp")

        # --- nothing else was touched
        if snapshot(p.ws, skip=lambda rel: rel == DEST or rel.startswith(DEST + "/")) != bystanders:
            out.violations.append("a bystander in the destination's parent changed")
        if snapshot(p.src) != src_before:
            out.violations.append("the source changed")
    except TimeoutError as exc:
        out.violations.append(f"hang: {exc}")
    finally:
        out.seconds = time.monotonic() - t0
        if not keep and not out.violations:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _wait_for_staging(ws: Path, pid: int, timeout: float = 120) -> None:
    """Until the writer's staging directory exists (or the writer is gone): random kills are
    timed from there, so startup time and a busy machine do not move them out of the writes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any((d / "data").is_dir() for d in our_staging(ws)):
            return
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat[stat.rfind(")") + 2] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.0005)


def random_fault(rng: random.Random, prep: Prepared, spread: float = 1.15) -> Fault:
    """A SIGKILL at a moment drawn uniformly from the time a clean run spends after creating its
    staging directory (writing, finalizing, publishing, cleaning up), and a little past it so the
    end of the run is in range too (some runs complete)."""
    return Fault("random", delay=round(rng.uniform(0.0, max(prep.staged_seconds, 0.01) * spread), 4))


# ----------------------------------------------------------------------------------------------
# Injected errors (no kill): the command must fail cleanly


# fault point -> the phase the error message must name; the error is raised where the next real
# system call of that phase would fail
ERRNO_PHASES = {"write-chunk": "write", "write-data": "write", "fsync-shard": "write", "index": "finalize",
                "extras-written": "finalize", "manifest-written": "finalize", "fsync-dir": "seal",
                "exchange": "publish", "rename-noreplace": "publish", "published": "publish"}
ERRNO_WORDS = {"ENOSPC": "no space left", "EIO": "I/O error", "EXDEV": "different filesystems",
               "EACCES": "permission denied", "EROFS": "read-only"}


@dataclass
class ErrnoOutcome:
    scenario: str
    fault: str  # "<ERRNO> at <point>"
    rc: int | None = None
    phase_named: bool = False
    after: str = "?"  # old | new | mixed | absent
    staging_left: int = 0
    traceback: bool = False
    violations: list[str] = field(default_factory=list)


def run_errno_trial(prep: Prepared, point: str, err: str, work: Path, runner: Any) -> ErrnoOutcome:
    """``CKPTCTL_FAIL_AT=<point>:<err>``: exit 3, one error line naming the phase and the cause, no
    traceback, nothing left behind, and the destination untouched. After the publish rename
    (``published``) the destination is the complete new version instead."""
    out = ErrnoOutcome(prep.scn.name, f"{err} at {point}")
    p = prep.instantiate(work)
    before = snapshot(p.ws)
    env = {**prep.scn.env, "CKPTCTL_FAIL_AT": f"{point}:{err}"}
    try:
        r = runner.run(prep.scn.argv(p.src, p.dst), env=env)
    except TimeoutError as exc:
        out.violations.append(f"hang: {exc}")
        return out
    out.rc = r.rc
    out.traceback = "Traceback" in r.stderr
    out.phase_named = f"(phase: {ERRNO_PHASES[point]})" in r.stderr
    out.staging_left = len(our_staging(p.ws))
    out.after = _classify(p.dst, prep)
    if out.after == "absent" and prep.old_absent:
        out.after = "old"
    if r.rc != 3:
        out.violations.append(f"exit {r.rc}, expected 3: {r.stderr[-300:]}")
    if out.traceback or "error:" not in r.stderr or ERRNO_WORDS[err] not in r.stderr:
        out.violations.append(f"not a one-line error naming the cause: {r.stderr[-300:]}")
    if not out.phase_named:
        out.violations.append(f"the message does not name the phase {ERRNO_PHASES[point]}: {r.stderr[-300:]}")
    if out.staging_left:
        out.violations.append("staging left behind")
    expected = "new" if point in PUBLISHED_POINTS else "old"
    if out.after != expected:
        out.violations.append(f"destination is {out.after}, expected {expected}")
    elif expected == "old" and snapshot(p.ws) != before:
        out.violations.append("something in the destination's parent changed")
    elif expected == "new":
        out.violations += check_version(p.dst, prep.new_tensors) + check_marker(p.dst)
    if not out.violations:
        shutil.rmtree(work, ignore_errors=True)
    return out


def errno_faults(scn: Scenario) -> list[tuple[str, str]]:
    """The injected errors a scenario can meet: one per phase it reaches."""
    table = [("write-chunk", "ENOSPC"), ("write-data", "EIO"), ("fsync-shard", "EIO"), ("index", "ENOSPC"),
             ("extras-written", "EIO"), ("manifest-written", "ENOSPC"), ("fsync-dir", "EIO"),
             ("exchange", "EIO"), ("exchange", "EXDEV"), ("rename-noreplace", "ENOSPC"), ("published", "EIO")]
    return [(pt, e) for pt, e in table if pt in scn.points]


def summarize_errno(outcomes: list[ErrnoOutcome]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for o in outcomes:
        family = "export" if o.scenario.startswith(("export", "big-export")) else "resave"
        r = rows.setdefault((family, o.fault), {"command": family, "fault": o.fault, "tried": 0, "exit 3": 0,
                                                "phase named": 0, "old": 0, "new": 0, "lost or mixed": 0,
                                                "staging left": 0, "traceback": 0, "violations": 0})
        r["tried"] += 1
        r["exit 3"] += o.rc == 3
        r["phase named"] += o.phase_named
        r[o.after if o.after in ("old", "new") else "lost or mixed"] += 1
        r["staging left"] += o.staging_left
        r["traceback"] += o.traceback
        r["violations"] += bool(o.violations)
    order = {p: i for i, p in enumerate(ALL_POINTS)}
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], order.get(k[1].split(" at ")[1], 99), k[1]))]


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    tot = {h: sum(r[h] for r in rows) for h in head[2:]}
    lines.append("| **total** | | " + " | ".join(f"**{tot[h]}**" for h in head[2:]) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Tables


OUTCOME_COLUMNS = ["old", "new", "window", "lost", "mixed"]


def summarize(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Rows ``fault -> count, outcomes`` (killed trials only; random kills by the phase they hit)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for o in outcomes:
        if not o.killed:
            continue
        fault = o.fault if o.phase is None else f"random kill ({o.phase})"
        family = "export" if o.scenario.startswith(("export", "big-export")) else "resave"
        if "two-rename" in o.scenario:
            family += " (two-rename)"
        key = (family, fault)
        r = rows.setdefault(key, {"command": family, "fault": fault, "kills": 0, **{c: 0 for c in OUTCOME_COLUMNS},
                                  "recovered": 0, "leaked_after_gc": 0, "gc_touched_other": 0,
                                  "rerun_identical": 0, "violations": 0})
        r["kills"] += 1
        r[o.after_kill if o.after_kill in OUTCOME_COLUMNS else "mixed"] += 1
        if o.after_kill == "window" and o.after_recovery in ("old", "new"):
            r["recovered"] += 1
        r["leaked_after_gc"] += o.leaked_after_gc
        r["gc_touched_other"] += int(o.gc_touched_other)
        r["rerun_identical"] += int(o.rerun_identical)
        r["violations"] += int(bool(o.violations))
    order = {p: i for i, p in enumerate(ALL_POINTS)}

    def key(k: tuple[str, str]) -> tuple:
        fam, fault = k
        pt = fault.removeprefix("kill at ")
        return (fam, fault.startswith("random"), order.get(pt, 99), fault)

    return [rows[k] for k in sorted(rows, key=key)]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["command", "fault", "kills", *OUTCOME_COLUMNS, "recovered", "leaked after gc-tmp",
            "gc-tmp touched other", "re-run identical", "trials with a violation"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tot = {h: 0 for h in head[2:]}
    for r in rows:
        vals = [r["kills"], *(r[c] for c in OUTCOME_COLUMNS), r["recovered"], r["leaked_after_gc"],
                r["gc_touched_other"], r["rerun_identical"], r["violations"]]
        for h, v in zip(head[2:], vals):
            tot[h] += v
        lines.append("| " + " | ".join([r["command"], r["fault"], *map(str, vals)]) + " |")
    lines.append("| **total** | | " + " | ".join(f"**{tot[h]}**" for h in head[2:]) + " |")
    return "\n".join(lines)
