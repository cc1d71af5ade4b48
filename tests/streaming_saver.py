"""A streaming checkpoint saver of the kind the seed report used (mcore-bridge style), run as a
real process by tests/test_repair_states.py so that a real SIGKILL leaves the states such writers
leave behind.

It saves the tensors of one safetensors file into DIR in place, the way those savers do:

1. each shard is written with ``safetensors.torch.save_file`` as ``model-0000K-of-?????.safetensors``
   (the count is not known while streaming);
2. once all are written, each is renamed to ``model-0000K-of-0000N.safetensors`` (or
   ``model.safetensors`` when there is one);
3. the index is written (sharded saves only);
4. the previous save's files that the new one did not overwrite are removed, one at a time.

``--stop-at POINT`` (``written``, ``renamed-K``, ``renamed``, ``indexed``, ``cleanup-K``) prints ``STOPPED POINT``
and waits there to be killed.

usage: python tests/streaming_saver.py SOURCE.safetensors DIR --per-shard K [--stop-at POINT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from safetensors.torch import load_file, save_file


def _stop(point: str, stop_at: str | None) -> None:
    if point == stop_at:
        print(f"STOPPED {point}", flush=True)
        while True:
            time.sleep(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("dir")
    ap.add_argument("--per-shard", type=int, required=True)
    ap.add_argument("--stop-at")
    args = ap.parse_args()
    tensors = load_file(args.source)
    names = sorted(tensors)
    groups = [names[i:i + args.per_shard] for i in range(0, len(names), args.per_shard)]
    before = set(os.listdir(args.dir))
    temp = []
    for k, group in enumerate(groups, start=1):
        path = os.path.join(args.dir, f"model-{k:05d}-of-?????.safetensors")
        save_file({n: tensors[n] for n in group}, path, metadata={"format": "pt"})
        temp.append(path)
    _stop("written", args.stop_at)
    n = len(groups)
    final = ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    for k, (src, dst) in enumerate(zip(temp, final), start=1):
        os.replace(src, os.path.join(args.dir, dst))
        _stop(f"renamed-{k}", args.stop_at)
    _stop("renamed", args.stop_at)
    if n > 1:
        weight_map = {t: final[k] for k, group in enumerate(groups) for t in group}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _stop("indexed", args.stop_at)
    stale = sorted(before - set(final) - {"model.safetensors.index.json"})
    stale = [s for s in stale if s.startswith("model") and s.endswith(".safetensors")]
    if n == 1 and "model.safetensors.index.json" in before:
        stale.append("model.safetensors.index.json")
    for i, name in enumerate(stale, start=1):
        os.remove(os.path.join(args.dir, name))
        _stop(f"cleanup-{i}", args.stop_at)
    print("DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
