"""A header's memory is bounded by a compact record per tensor (issue 15, last item): ``verify``
and ``inspect --json`` of a legal header with hundreds of thousands of entries stay far below
what a JSON tree of it costs (a dict and two lists per entry, then a dict or row per tensor
again). Measured as the peak RSS of the real process.

On main before this change: verify 294 MB, inspect --json 342 MB; now about 108 MB each (a
bare verify is about 37 MB). Both readers are held to it: the fast one (msgspec, the header cut
into pieces) and the reference (``CKPTCTL_FAST_METADATA=0``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptctl.format.header import encode_header
from ckptctl.format.tensor import TensorSpec
from tests.support.cli import CKPTCTL, RUN_TIMEOUT, clean_env

N = 300_000
PEAK_LIMIT_KB = 180 * 1024


def _header(n: int) -> bytes:
    """The header ``encode_header`` writes for ``l.0`` ... ``l.{n-1}``, one BF16 element each,
    made by string joins (``encode_header`` itself takes seconds at this size)."""
    body = ",".join(f'"{name}":{{"dtype":"BF16","shape":[1],"data_offsets":[{2 * j},{2 * j + 2}]}}'
                    for j, name in enumerate(sorted(f"l.{i}" for i in range(n))))
    text = ("{" + body + "}").encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def test_the_generated_header_is_what_the_writer_writes() -> None:
    # the layout's order is by name (one dtype): offsets follow it
    assert _header(12) == encode_header([TensorSpec(f"l.{i}", "BF16", (1,)) for i in range(12)])[0]


@pytest.fixture(scope="module")
def huge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("huge-header") / "model.safetensors"
    path.write_bytes(_header(N) + bytes(2 * N))
    return path


# A child's peak RSS counts what its parent held when it was forked (exec records the old
# memory's high-water mark), and pytest holds torch: so a small Python process starts ckptctl and
# reports its child's peak.
_MEASURE = """
import resource, subprocess, sys
with open(sys.argv[1], "wb") as out:
    code = subprocess.call(sys.argv[2:], stdout=out)
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _run(tmp: Path, fast: bool, *args: object) -> tuple[int, bytes]:
    """(peak RSS in KiB, stdout) of a successful ``ckptctl ARGS`` in its own process."""
    out = tmp / "stdout"
    env = clean_env({"CKPTCTL_FAST_METADATA": "1" if fast else "0"})
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(out), *CKPTCTL, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT)
    code, peak = map(int, done.stdout.split())
    assert code == 0, done.stderr[-2000:]
    return peak, out.read_bytes()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "strict"])
def test_verify_of_a_huge_header_is_bounded(huge: Path, tmp_path: Path, fast: bool) -> None:
    peak, _ = _run(tmp_path, fast, "verify", "-q", huge)
    assert peak < PEAK_LIMIT_KB, f"verify peaked at {peak // 1024} MiB for {N:,} tensors"


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "strict"])
def test_inspect_json_of_a_huge_header_is_bounded(huge: Path, tmp_path: Path, fast: bool) -> None:
    peak, out = _run(tmp_path, fast, "inspect", "--json", huge)
    assert peak < PEAK_LIMIT_KB, f"inspect --json peaked at {peak // 1024} MiB for {N:,} tensors"
    head, tail = out[:2000].decode(), out[-200:].decode()
    assert f'"tensor_count": {N}, "parameters": {N}, "total_bytes": {2 * N}' in head
    assert tail.endswith('"bytes": 2, "file": "model.safetensors"}]}\n') and out.count(b"\n") == 1
