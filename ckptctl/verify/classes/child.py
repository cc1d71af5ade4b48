"""The class-check child (``python -m ckptctl.verify.classes.child REQ_FD RESP_FD ADDRESS_SPACE``):
the process of the box (:mod:`.box`) that builds model classes. It bounds itself before any
library is imported (:mod:`.guard`: address space, no network, killed with its parent), then
answers requests, one JSON line each on ``REQ_FD``, with one JSON line each on ``RESP_FD`` until
the requests end. Its stdin, stdout and stderr are /dev/null: nothing a library prints reaches
verify's output, nothing it reads consumes a request.

A request names the oracle (``transformers``, ``diffusers``, ``st``, ``peft``) and carries
config.json (and adapter_config.json) as parsed and the checkpoint's tensors as
``[name, dtype, shape]`` rows; the answer is plain data: an :class:`~.outcome.Outcome` as a dict,
or why no outcome (``not_checked``, ``refused``, ``bound`` with ``which``, ``failed``). Whatever
the build raises, SystemExit included, becomes an answer. The libraries stay imported between
requests: one child serves a whole verify run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

from ckptctl.format.tensor import TensorSpec
from ckptctl.verify.classes import guard
from ckptctl.verify.classes.outcome import NotChecked, Outcome, Refused


def _tensors(rows: list[list[Any]]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows}


def build(req: dict[str, Any]) -> Outcome:
    """The outcome of one request's oracle."""
    op, cfg, tensors = req["op"], req["cfg"], _tensors(req["tensors"])
    if op == "transformers":
        from ckptctl.verify.classes.transformers_class import check_transformers

        return check_transformers(cfg, tensors, req["where"], req.get("cls"))
    if op == "diffusers":
        from ckptctl.verify.classes.diffusers_class import check_diffusers

        return check_diffusers(cfg, tensors, req.get("cls"), single_file=bool(req.get("single_file")))
    if op == "st":
        from ckptctl.verify.classes.diffusers_class import check_st_module

        return check_st_module(cfg, tensors, req["cls"])
    if op == "peft":
        from ckptctl.verify.classes.peft_class import check_peft

        return check_peft(req["acfg"], tensors, cfg)
    raise NotChecked(f"unknown class-check request {op!r}")


def _first(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def serve(req: dict[str, Any], tried: list[str]) -> dict[str, Any]:
    """The answer to one request (never raises)."""
    tried.clear()
    try:
        answer: dict[str, Any] = {"kind": "outcome", "outcome": asdict(build(req))}
    except NotChecked as exc:
        answer = {"kind": "not_checked", "reason": exc.reason}
    except Refused as exc:
        answer = {"kind": "refused", "reason": exc.reason}
    except guard.BoundHit as exc:
        answer = {"kind": "bound", "which": exc.which, "reason": exc.detail}
    except BaseException as exc:  # noqa: BLE001 -- SystemExit and KeyboardInterrupt included: an answer
        which = guard.bound_hit(exc)
        answer = {"kind": "bound", "which": which, "reason": _first(exc)} if which else \
            {"kind": "failed", "reason": _first(exc)}
    if tried:  # whatever came of it, the build reached for the network
        answer = {"kind": "bound", "which": "network", "reason": f"it tried to connect ({tried[0]})"}
    if answer.get("which") == "memory":
        answer["restart"] = True  # a refused allocation may leave a library half-initialised
    return answer


def main(argv: list[str]) -> int:
    req_fd, resp_fd, address_space = int(argv[1]), int(argv[2]), int(argv[3])
    guard.die_with_parent()
    guard.isolate_network()
    tried: list[str] = []
    guard.refuse_network(tried)
    guard.limit_memory(address_space)
    with os.fdopen(req_fd, "rb") as requests, os.fdopen(resp_fd, "wb") as answers:
        for line in requests:
            try:
                req = json.loads(line)
            except ValueError:
                return 2
            answer = serve(req, tried)
            try:
                answers.write(json.dumps(answer).encode() + b"\n")
                answers.flush()
            except (OSError, ValueError, TypeError):
                return 3
            if answer.get("restart"):
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
