"""The follower: look at the followed directory, export each complete save once, in step order.

:class:`Follower` ``run()`` locks ``DST_ROOT``'s state, finishes what a killed follower left,
then passes over the saves until told to stop: ``--once`` (passes until nothing is left to do
now, then exit: the cron form), ``--exit-when-idle`` (nothing happened for that long), or a
signal (``KeyboardInterrupt``, raised by the CLI's handler for SIGTERM/SIGHUP/Ctrl-C: a running
export cleans up as any export does, and nothing is half-published).

Each pass lists the saves by step and takes the first complete one not handled yet: one export
at a time, and the directory is looked at again after each (a trainer may have deleted or
written saves meanwhile). A save is handled once per identity (completion.py): a save written
again under the same name (a new DCP save id, a new trainer_state.json) is a new save, and
replaces the follower's own export of the old one. Between passes the follower sleeps
(``--poll-interval``): a pass lists the directory and stats the saves' files; what it holds in
memory is bounded by the saves present (the last reason each one is waiting for, the last
fingerprint seen of each).
"""

from __future__ import annotations

import time
from typing import Any

from ckptctl.errors import from_oserror
from ckptctl.follow.completion import Judgement, judge
from ckptctl.follow.events import EmitFn, Event
from ckptctl.follow.handle import Handler
from ckptctl.follow.metacache import MetadataCache
from ckptctl.follow.options import FollowOptions
from ckptctl.follow.saves import Fingerprint, Save, fingerprint, list_saves, quick_key
from ckptctl.follow.state import FINAL, FollowState


class Follower:
    def __init__(self, opts: FollowOptions, emit: EmitFn) -> None:
        self.opts = opts
        self.emit = emit
        self.state: FollowState | None = None
        self.handler: Handler | None = None
        self.waiting: dict[str, str] = {}  # save name -> the reason last reported
        self.seen: dict[str, str] = {}  # save name -> the fingerprint digest of the last look
        self.handled_key: dict[str, tuple] = {}  # handled save name -> quick key: not looked at again
        self.activity = False  # a waiting save changed during the pass (not idle)
        self.wake_ns: int | None = None  # the end of the earliest quiet period waited for (wall clock)
        self.metadata = MetadataCache.if_enabled()  # a waiting DCP save's .metadata parsed once per version

    def run(self) -> int:
        """Follow until told to stop; returns the number of exports published by this run."""
        opts = self.opts
        if opts.low_priority:
            from ckptctl.follow.priority import lower

            for problem in lower():
                self.emit(Event("warning", problem))
        self.state = FollowState.open(opts.dst_root, source=opts.source, start_from=opts.start_from,
                                      command=opts.command, fsync=opts.export.fsync)
        try:
            self.handler = Handler(opts, self.state, self.emit)
            published_before = self._count_published()
            self.emit(Event("start", f"following {opts.source} into {opts.dst_root}", fields={
                "source": str(opts.source), "dst_root": str(opts.dst_root), "resumed": len(self.state.records),
                "from": self.state.settings.get("from")}))
            self.handler.resume()
            self.handler.retain()  # the rules given now, on what earlier runs published
            idle_since = time.monotonic()
            while True:
                did = self.one_pass()
                if did or self.activity:
                    idle_since = time.monotonic()
                if did:
                    continue
                if opts.once:
                    self.emit(Event("done", "pass complete", fields=self._summary()))
                    break
                if opts.exit_when_idle is not None and time.monotonic() - idle_since >= opts.exit_when_idle:
                    self.emit(Event("idle", f"nothing to do for {opts.exit_when_idle:g}s; exiting",
                                    fields=self._summary()))
                    break
                time.sleep(self._pause())
            return self._count_published() - published_before
        finally:
            self.state.close()

    def _pause(self) -> float:
        """Seconds until the next look: the poll interval, or less when a save's quiet period ends
        sooner (a save is published a quiet period after its last change, not a poll later)."""
        if self.wake_ns is None:
            return self.opts.poll
        return max(0.01, min(self.opts.poll, (self.wake_ns - time.time_ns()) / 1e9 + 0.01))

    def _count_published(self) -> int:
        assert self.state is not None
        return sum(1 for r in self.state.records.values() if r.get("published_at"))

    def _summary(self) -> dict[str, Any]:
        assert self.state is not None
        counts: dict[str, int] = {}
        for r in self.state.records.values():
            counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
        return {"records": counts, "waiting": dict(self.waiting)}

    # ---------------------------------------------------------------------------------------
    def one_pass(self) -> bool:
        """Look once; export at most one save. True when something was handled (look again)."""
        assert self.state is not None and self.handler is not None
        self.activity = False
        self.wake_ns = None
        try:
            _kind, saves = list_saves(self.opts.source, self.state.records)
        except OSError as exc:
            raise from_oserror(exc, f"cannot list {self.opts.source}") from None
        if not self.state.baseline_set:
            self._set_baseline(saves)
        did = self._vanished({s.name for s in saves})
        for save in saves:
            rec = self.state.records.get(save.name)
            status = rec.get("status") if rec else None
            if status == "skipped":
                continue  # older than following: for good
            key = quick_key(save) if status in FINAL else None
            if key is not None and self.handled_key.get(save.name) == key:
                continue  # handled, and neither its folder nor its marker changed since
            try:
                fp = fingerprint(save.path)
            except FileNotFoundError:
                continue  # deleted while listed: the next pass says so
            except OSError as exc:
                self._wait(save, f"unreadable ({exc.strerror or exc})")
                continue
            if self._consider(save, fp, key):
                return True
        return did

    def _consider(self, save: Save, fp: Fingerprint, key: tuple | None) -> bool:
        """Handle ``save`` if it is complete and new; True when something was recorded. ``key``:
        the quick key of a handled save (remembered once it is judged the same save)."""
        assert self.state is not None and self.handler is not None
        rec = self.state.records.get(save.name)
        status = rec.get("status") if rec else None
        if rec is not None and fp.digest in (rec.get("lost_digest"), rec.get("refused_digest")):
            return False  # the very files that were lost or refused: wait for a change
        judged = judge(save, fp, now_ns=time.time_ns(), quiet_s=self.opts.quiet, cache=self.metadata)
        if status in FINAL and not judged.complete:
            self._wait(save, f"being saved again? {judged.reason}", fp)
            return False
        if status in FINAL and rec.get("identity") == judged.identity:  # type: ignore[union-attr]
            if key is not None:
                self.handled_key[save.name] = key  # the same save (files added after it: a tokenizer)
            self.waiting.pop(save.name, None)
            return False
        baseline = self.state.settings.get("baseline")
        if (rec is None or status == "waiting") and baseline is not None and save.step < baseline:
            self.state.put({"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path),
                            "status": "skipped"}, {"event": "skipped"})
            self.emit(Event("skipped", f"skipped {save.name}: older than step {baseline}, the newest when "
                            "following began (--from newest)", save.name, save.step))
            return True
        if not judged.complete:
            if judged.quiet_at_ns is not None:
                self.wake_ns = min(self.wake_ns or judged.quiet_at_ns, judged.quiet_at_ns)
            self._wait(save, judged.reason or "incomplete", fp)
            return False
        if not self.opts.once and self.opts.quiet > 0 and self.seen.get(save.name) != fp.digest:
            second = time.time_ns() + int(min(self.opts.poll, 1.0) * 1e9)  # a second look, soon
            self.wake_ns = min(self.wake_ns or second, second)
            self._wait(save, "complete; checking that it stays the same", fp)
            return False
        self.waiting.pop(save.name, None)
        self.seen.pop(save.name, None)
        return self.handler.export(save, fp, judged, rec)

    def _wait(self, save: Save, reason: str, fp: Fingerprint | None = None) -> None:
        """``save`` is not complete: said once per reason, and recorded (status ``waiting``) when
        no other record exists, so that its deletion is reported even by the next follower."""
        assert self.state is not None
        if fp is not None:
            if self.seen.get(save.name) not in (None, fp.digest):
                self.activity = True  # being written: not idle
            self.seen[save.name] = fp.digest
        if self.waiting.get(save.name) == reason:
            return
        self.waiting[save.name] = reason
        rec = self.state.records.get(save.name)
        if rec is None or (rec.get("status") == "waiting" and rec.get("reason") != reason):
            self.state.put({"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path),
                            "status": "waiting", "reason": reason})
        self.emit(Event("waiting", f"waiting for {save.name}: {reason}", save.name, save.step, {"reason": reason}))

    def _vanished(self, listed: set[str]) -> bool:
        """Saves recorded waiting that are gone: lost (deleted before they were exported)."""
        assert self.handler is not None and self.state is not None
        did = False
        for name in [n for n in self.waiting if n not in listed]:
            del self.waiting[name]
            self.seen.pop(name, None)
        for rec in [r for r in self.state.records.values() if r.get("status") == "waiting" and r["name"] not in listed]:
            step = rec.get("step")
            gone = Save(rec.get("kind", "?"), rec["name"], step if isinstance(step, int) else -1,
                        self.opts.source / rec["name"])
            self.handler.lost(gone, Judgement(False), f"deleted before it was exported (it was waiting: "
                              f"{rec.get('reason')})", None)
            did = True
        for name in [n for n in self.handled_key if n not in listed]:
            del self.handled_key[name]
        return did

    def _set_baseline(self, saves: list[Save]) -> None:
        """First start: with --from newest, the newest complete save's step (older ones are
        skipped); with --from all, none."""
        assert self.state is not None
        baseline = None
        if self.opts.start_from == "newest":
            for save in reversed(saves):
                try:
                    fp = fingerprint(save.path)
                except OSError:
                    continue
                if judge(save, fp, now_ns=time.time_ns(), quiet_s=self.opts.quiet, cache=self.metadata).complete:
                    baseline = save.step
                    break
        self.state.set_baseline(baseline)


def follow(opts: FollowOptions, emit: EmitFn) -> int:
    """Check ``opts``, then :meth:`Follower.run`."""
    opts.check()
    try:
        return Follower(opts, emit).run()
    except OSError as exc:  # a state or listing error not already described
        raise from_oserror(exc, "following failed") from None
