"""``verify --deep`` (sha256 of every byte plus the NaN/Inf/all-zero scan of every float) beside
``sha256sum`` of the same files (coreutils, one file at a time) and Python's hashlib (OpenSSL)
hashing the files on two threads, which is the floor for any Python tool that hashes (the
reference of the ratios): of the 2 GB checkpoint in 4 shards, and of the same size as one file
(whose sha256 no tool can spread over two cores: hashlib's floor there is one thread). Each also
with the fast paths off (``CKPTCTL_FAST_METADATA=0``: the reference scan, one reader and one decoder
thread per file, two files at a time), to show what the fast path earns. Both with ``--static``:
the hashing is what is measured; a last row adds the model-class check (issue 30), which imports
torch and transformers' modeling code (about 5 s on this machine) whatever the checkpoint's size.

``export-manifest``: ``export --manifest`` (the sha256 of every file it writes, taken while it
writes) beside the same ``export`` without it (the reference), and with the digests' early reader
off (``ShardDigest(early=False)``: what the kernel copied is read back once the shard is written)."""

from __future__ import annotations

import shlex
import sys
from functools import partial

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command, clear

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
SINGLE = Spec(size=2 * 10**9, dtype="bf16", single=True)
HASHLIB_2 = ("import sys, glob, hashlib\nfrom concurrent.futures import ThreadPoolExecutor\n"
             "def h(p):\n"
             "    d, b = hashlib.sha256(), bytearray(8 << 20)\n"
             "    with open(p, 'rb', buffering=0) as f:\n"
             "        while n := f.readinto(b):\n"
             "            d.update(memoryview(b)[:n])\n"
             "    return d.hexdigest()\n"
             "with ThreadPoolExecutor(2) as x:\n"
             "    list(x.map(h, sorted(glob.glob(sys.argv[1] + '/*.safetensors'))))\n")
HASHLIB = "hashlib sha256, 2 threads"
# the same command with every shard's digest made by the reference (read back at the end)
EARLY_OFF = ("import functools, sys; from ckptctl.write import digest, shards; "
             "shards.ShardDigest = functools.partial(digest.ShardDigest, early=False); "
             "from ckptctl.cli import main; sys.argv[0] = 'ckptctl'; main()")


def _deep(name: str, spec: Spec) -> Case:
    src = WORK / spec.name()
    reference = "CKPTCTL_FAST_METADATA=0 " + shlex.join([*CKPTCTL, "verify", "--deep", "--static", str(src), "-q"])
    return Case(name, f"{spec.name()}: hash every byte (and scan every float)",
                [Command("sha256sum", f"sha256sum {shlex.quote(str(src))}/*.safetensors"),
                 Command(HASHLIB, [sys.executable, "-c", HASHLIB_2, str(src)]),
                 Command("ckptctl verify --deep --static", [*CKPTCTL, "verify", "--deep", "--static", str(src), "-q"]),
                 Command("ckptctl verify --deep --static (fast paths off)", reference),
                 Command("ckptctl verify --deep (with the model-class check)",
                         [*CKPTCTL, "verify", "--deep", str(src), "-q"])],
                prepare=partial(ensure, spec), reference=HASHLIB, prefault=2**29)


def _export_manifest() -> Case:
    src, out = WORK / SPEC.name(), WORK / "out" / "export-manifest"
    c_out = clear(out)
    argv = [*CKPTCTL, "export", str(src), str(out), "--max-shard-size", "1GB", "-q"]
    return Case("export-manifest", f"{SPEC.name()}: export into 1 GB shards, with and without --manifest",
                [Command("ckptctl export", argv, setup=c_out, teardown=c_out),
                 Command("ckptctl export --manifest", [*argv, "--manifest"], setup=c_out, teardown=c_out),
                 Command("ckptctl export --manifest (digest read back at the end)",
                         [sys.executable, "-c", EARLY_OFF, *argv[3:], "--manifest"], setup=c_out, teardown=c_out)],
                prepare=partial(ensure, SPEC), prefault=2 * SPEC.size + 2**29)


CASES = [_deep("deep-verify", SPEC), _deep("deep-verify-single", SINGLE), _export_manifest()]
