"""``verify --deep`` (sha256 of every byte plus the NaN/Inf/all-zero scan of every float) beside
``sha256sum`` of the same files (coreutils, one file at a time: the reference) and Python's
hashlib (OpenSSL) hashing the files on two threads, which is the floor for any Python tool that
hashes."""

from __future__ import annotations

import shlex
import sys
from functools import partial

from bench.gen import WORK, Spec, ensure
from bench.harness import CKPTCTL, Case, Command

SPEC = Spec(size=2 * 10**9, dtype="bf16", shards=4)
HASHLIB_2 = ("import sys, glob, hashlib\nfrom concurrent.futures import ThreadPoolExecutor\n"
             "def h(p):\n"
             "    d, b = hashlib.sha256(), bytearray(8 << 20)\n"
             "    with open(p, 'rb', buffering=0) as f:\n"
             "        while n := f.readinto(b):\n"
             "            d.update(memoryview(b)[:n])\n"
             "    return d.hexdigest()\n"
             "with ThreadPoolExecutor(2) as x:\n"
             "    list(x.map(h, sorted(glob.glob(sys.argv[1] + '/*.safetensors'))))\n")

_src = WORK / SPEC.name()
CASES = [
    Case("deep-verify", f"{SPEC.name()}: hash every byte (and scan every float)",
         [Command("sha256sum", f"sha256sum {shlex.quote(str(_src))}/*.safetensors"),
          Command("hashlib sha256, 2 threads", [sys.executable, "-c", HASHLIB_2, str(_src)]),
          Command("ckptctl verify --deep", [*CKPTCTL, "verify", "--deep", str(_src), "-q"])],
         prepare=partial(ensure, SPEC), prefault=2**29),
]
