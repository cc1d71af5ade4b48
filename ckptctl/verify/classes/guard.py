"""The inside of the class-check box (:mod:`.box`): what the child process sets up before it
imports any library, and how it tells a bound it hit from a library's refusal.

* memory: ``RLIMIT_AS`` (the address space the child may map) and no core file;
* network: a new network namespace where the kernel allows one (``unshare``: nothing but a
  loopback that is down, for Python and native code alike), and in every case an audit hook that
  refuses every socket connection, name lookup and datagram (``sys.addaudithook``: it cannot be
  removed), recording what was tried;
* lifetime: the child is killed when verify dies (``PR_SET_PDEATHSIG``).

The environment the child starts with (the Hub and the ``kernels`` package offline, an empty
cache of its own) is :func:`ckptctl.verify.classes.box.child_environment`.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

# audit events of a connection out of the process (CPython's socket module)
NETWORK_EVENTS = frozenset({"socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                            "socket.getnameinfo", "socket.sendto", "socket.sendmsg"})
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG = 1
# where a library asks the Hub (or a kernel repository) for what config.json names: an exception
# raised in one of these files (not merely through one: the kernels package wraps every layer's
# __init__) means the build needed the network
HUB_CODE = ("/huggingface_hub/", "/kernels/_internals/hf_hub.py", "/kernels/_internals/install.py",
            "/kernels/_internals/resolver.py", "/kernels/_internals/_versions.py", "/kernels/_internals/locking.py",
            "/transformers/utils/hub.py", "/diffusers/utils/hub_utils.py", "/transformers/dynamic_module_utils.py",
            "/timm/models/_hub.py", "/torch/hub.py")
# what an allocation refused by RLIMIT_AS looks like when it is not a MemoryError
MEMORY_WORDS = ("can't allocate memory", "not enough memory", "cannot allocate memory", "can't start new thread",
                "std::bad_alloc", "out of memory", "failed to map segment", "memoryerror")


class NetworkBlocked(ConnectionRefusedError):
    """A connection the box refused."""


def limit_memory(address_space: int) -> None:
    """The child's address space capped at ``address_space`` bytes; no core file."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space if hard == resource.RLIM_INFINITY else min(address_space, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def die_with_parent() -> None:
    """SIGKILL when the process that started the child (verify) exits, on Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def isolate_network() -> bool:
    """A network namespace of the child's own (no interface up), if the kernel lets this user make
    one; False where it does not (the audit hook of :func:`refuse_network` still stands). Call
    it while the process has one thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
        return True
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    try:  # the same ids inside, so files keep their owners
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError:
        pass
    return True


def refuse_network(tried: list[str]) -> None:
    """Every socket connection, lookup and datagram of this process refused
    (:class:`NetworkBlocked`) for the rest of its life; what was tried is appended to ``tried``."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in NETWORK_EVENTS:
            target = args[1] if event in ("socket.connect", "socket.sendto") and len(args) > 1 else args[:1]
            tried.append(f"{event} {target!r}"[:200])
            raise NetworkBlocked(f"the model-class check has no network ({event})")

    sys.addaudithook(hook)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 20:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def asked_the_hub(exc: BaseException) -> bool:
    """Whether ``exc`` (or one it was raised from) is the Hub's (its type), was raised in code that
    fetches from the Hub or a kernel repository, or by the network guard: the build needed the
    network."""
    for e in _chain(exc):
        if isinstance(e, NetworkBlocked) or type(e).__module__.startswith("huggingface_hub"):
            return True
        frames = list(traceback.walk_tb(e.__traceback__))
        if frames:  # the frame that raised it
            name = frames[-1][0].f_code.co_filename.replace(os.sep, "/")
            if any(part in name for part in HUB_CODE):
                return True
    return False


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation the address-space bound refused."""
    for e in _chain(exc):
        if isinstance(e, MemoryError):
            return True
        text = str(e).lower() if isinstance(e, (RuntimeError, OSError, ImportError)) else ""
        if any(w in text for w in MEMORY_WORDS):
            return True
    return False


def bound_hit(exc: BaseException) -> str | None:
    """``"memory"`` or ``"network"`` when ``exc`` is the box's bound rather than the library's own
    judgement of config.json, else None."""
    if out_of_memory(exc):
        return "memory"
    if asked_the_hub(exc):
        return "network"
    return None


def guarded(run: Callable[[], Any]) -> Any:
    """``run()``; an exception that is a bound of the box (:func:`bound_hit`) is re-raised as
    :class:`BoundHit`."""
    try:
        return run()
    except BaseException as exc:  # noqa: BLE001 -- sorted below, re-raised
        which = bound_hit(exc)
        if which is None:
            raise
        raise BoundHit(which, exc) from None


class BoundHit(Exception):
    """A bound of the box (``which``: memory or network) stopped the build."""

    def __init__(self, which: str, exc: BaseException) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        super().__init__(f"{which}: {type(exc).__name__}: {first}")
        self.which = which
        self.detail = f"{type(exc).__name__}: {first}"
