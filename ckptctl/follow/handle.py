"""What the follower does with one complete save: record, export, settle, verify, hook, retain.

Every step is recorded before it is taken (``exporting``, ``removing``), so a follower killed at
any point is finished by the next one (:meth:`Handler.resume`): a publish that happened is
recognised by the destination's identity (another directory than before the export), one that
did not leaves no record (the save is exported again); a half-done removal is finished.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptctl import _faults
from ckptctl.errors import EXIT_USAGE, CkptctlError, Interrupted
from ckptctl.follow.completion import TRAINER_STATE, Judgement
from ckptctl.follow.events import EmitFn, Event
from ckptctl.follow.export import SaveChanged, export_save, pin
from ckptctl.follow.options import FollowOptions
from ckptctl.follow.retention import metrics_of, remove_export, still_ours, to_remove, tree_ids
from ckptctl.follow.saves import Fingerprint, Save, fingerprint
from ckptctl.follow.state import FollowState


def _dir_id(path: Path) -> dict[str, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return {"dev": st.st_dev, "ino": st.st_ino}


class Handler:
    """Exports, settles and retains for one follower (its options, state and event sink)."""

    def __init__(self, opts: FollowOptions, state: FollowState, emit: EmitFn) -> None:
        self.opts, self.state, self.emit = opts, state, emit

    def dest(self, name: str) -> Path:
        return self.opts.dst_root / name

    # ---- one export ----------------------------------------------------------------------
    def export(self, save: Save, fp: Fingerprint, judged: Judgement, prev: dict[str, Any] | None) -> bool:
        """Export ``save``; False when nothing was done (its destination is still blocked)."""
        dest = self.dest(save.name)
        ours = prev is not None and prev.get("status") == "published" and still_ours(dest, prev)
        if os.path.lexists(dest) and not ours:
            return self._blocked(save, judged, dest, prev)
        rec: dict[str, Any] = {"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path),
                               "dest": str(dest), "status": "exporting", "identity": judged.identity,
                               "fingerprint": fp.to_dict(), "dest_before": _dir_id(dest),
                               "metrics": self._metrics(save)}
        if ours:
            rec["previous"] = {k: v for k, v in prev.items() if k != "previous"}  # type: ignore[union-attr]
        self.state.put(rec, {"event": "exporting"})
        self.emit(Event("exporting", f"exporting {save.name} (step {save.step})", save.name, save.step,
                        {"source": str(save.path), "dest": str(dest)}))
        _faults.point("follow-exporting")
        opts = replace(self.opts.export, overwrite=ours, command=f"{self.opts.command} [{save.name}]")
        try:
            result = export_save(save.path, dest, opts, key=self.opts.key, only=self.opts.only,
                                 check=pin(save.path, fp))
        except KeyboardInterrupt:
            if self.settle(rec):
                self.published(rec, None)
            raise
        except CkptctlError as exc:
            if self.settle(rec):  # published, then interrupted while cleaning up
                self.published(rec, None)
                if isinstance(exc, Interrupted):
                    raise KeyboardInterrupt from None
                return
            if isinstance(exc, Interrupted):
                raise KeyboardInterrupt from None
            self._failed(save, fp, judged, exc)
            return True
        self.published(rec, result)
        return True

    def _blocked(self, save: Save, judged: Judgement, dest: Path, prev: dict[str, Any] | None) -> bool:
        """``dest`` holds a directory the follower did not publish: left as it is, the save
        recorded ``blocked`` (said once), and exported once that directory is moved away."""
        there = _dir_id(dest)
        if prev is not None and prev.get("status") == "blocked" and prev.get("blocked_by") == there:
            return False
        why = f"{dest} exists and was not published by this follower; left as it is"
        rec = {"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path), "dest": str(dest),
               "status": "blocked", "identity": judged.identity, "blocked_by": there}
        self.state.put(rec, {"event": "refused", "reason": why})
        self.emit(Event("refused", f"refused {save.name}: {why}", save.name, save.step,
                        {"error": why, "hint": "move it aside: the save is exported on the next look"}))
        return True

    def _failed(self, save: Save, fp: Fingerprint, judged: Judgement, exc: CkptctlError) -> None:
        """Nothing was published: lost when the save changed or went, refused when the export
        refused it (exit 2); any other failure (disk full, permissions) stops the follower."""
        try:
            now: Fingerprint | None = fingerprint(save.path)
        except OSError:
            now = None
        if isinstance(exc, SaveChanged) or now is None or now.digest != fp.digest:
            self.lost(save, judged, str(exc), fp)  # those files are lost; the save as it is now is judged anew
        elif exc.exit_code == EXIT_USAGE:
            self._refuse(save, fp, judged, str(exc), exc.hint)
        else:
            raise exc

    def lost(self, save: Save, judged: Judgement, why: str, tried: Fingerprint | None) -> None:
        """Nothing published of ``save``; ``tried``: the files the export read (never tried again)."""
        rec = self.state.records.get(save.name)
        if rec is None or rec.get("status") not in ("published",):
            rec = {"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path),
                   "dest": str(self.dest(save.name)), "status": "lost", "identity": judged.identity}
        rec["lost_digest"] = tried.digest if tried is not None else None
        self.state.put(rec, {"event": "lost", "reason": why})
        self.emit(Event("lost", f"lost {save.name}: {why}", save.name, save.step, {"reason": why}))

    def _refuse(self, save: Save, fp: Fingerprint, judged: Judgement, why: str, hint: str | None) -> None:
        rec = self.state.records.get(save.name)
        if rec is None or rec.get("status") != "published":
            rec = {"name": save.name, "kind": save.kind, "step": save.step, "source": str(save.path),
                   "dest": str(self.dest(save.name)), "status": "refused", "identity": judged.identity}
        rec["refused_digest"] = fp.digest
        self.state.put(rec, {"event": "refused", "reason": why})
        self.emit(Event("refused", f"refused {save.name}: {why}", save.name, save.step,
                        {"error": why, "hint": hint}))

    def _metrics(self, save: Save) -> dict[str, float]:
        from ckptctl.format import small

        try:
            doc = small.read_json(save.path / TRAINER_STATE, limit=64 << 20)
        except (OSError, ValueError):
            return {}
        return metrics_of(doc, save.step)

    # ---- after an export ------------------------------------------------------------------
    def settle(self, rec: dict[str, Any]) -> bool:
        """Whether the export ``rec`` records was published (the destination is another directory
        than before it). A half-done publish a dead writer left is finished first. When it was
        not, the record goes (or the previous one comes back) and the save is exported again."""
        dest = Path(rec["dest"])
        try:
            from ckptctl.staging import recover_destination

            recover_destination(dest)
        except CkptctlError as exc:
            self.emit(Event("warning", f"cannot recover {dest}: {exc}", rec["name"], rec.get("step")))
        now, before = _dir_id(dest), rec.get("dest_before")
        if now is not None and now != before:
            return True
        if rec.get("previous"):
            self.state.put(rec["previous"])
        else:
            self.state.drop(rec["name"])
        return False

    def published(self, rec: dict[str, Any], result: Any) -> None:
        dest = Path(rec["dest"])
        rec.update(status="published", dest_id=_dir_id(dest), dest_files=tree_ids(dest), published_at=time.time(),
                   verified=None)
        for k in ("previous", "lost_digest", "refused_digest"):
            rec.pop(k, None)
        if result is not None:
            rec["export"] = {"files": len(getattr(result, "files", []) or []),
                             "bytes": getattr(result, "total_size", None),
                             "seconds": round(getattr(result, "seconds", 0.0), 3),
                             "publish": getattr(result, "publish", None)}
        if self.opts.verify:
            rec["verified"], rec["verify"] = self._verify(dest)
        if self.opts.on_publish:
            rec["on_publish"] = {"command": [*self.opts.on_publish, str(dest)], "status": "pending"}
        self.state.put(rec, {"event": "published"})
        _faults.point("follow-published")
        size = rec.get("export", {}).get("bytes")
        self.emit(Event("published", f"published {rec['name']} -> {dest}" + (f" ({size:,} bytes)" if size else "")
                        + ("" if rec["verified"] is None else " verified" if rec["verified"] else " FAILED verify"),
                        rec["name"], rec["step"], {"dest": str(dest), "verified": rec["verified"],
                                                   "export": rec.get("export")}))
        if self.opts.on_publish:
            self.hook(rec)
        self.retain()

    def _verify(self, dest: Path) -> tuple[bool, dict[str, Any]]:
        from ckptctl.verify import verify_path
        from ckptctl.verify.classes.box import close_shared_box

        try:
            res = verify_path(dest)
        except CkptctlError as exc:
            return False, {"error": str(exc)}
        finally:  # the class check's child (torch and the library imported) does not wait beside the trainer
            close_shared_box()
        return not res.failed(), {"counts": res.counts()}

    def hook(self, rec: dict[str, Any]) -> None:
        """Run ``--on-publish`` with the new path as its last argument (hook.py: no shell, its own
        process group, killed after ``--on-publish-timeout``). Its failure or timeout is
        recorded, never fatal."""
        from ckptctl.follow.hook import run_hook

        hook = rec["on_publish"]
        done = run_hook(hook["command"], self.opts.hook_timeout)
        hook.update(status=done.status, exit_code=done.exit_code, error=done.error, seconds=done.seconds,
                    at=time.time())
        self.state.put(rec, {"event": "hook", "status": done.status, "exit_code": done.exit_code})
        ok = done.status == "ok"
        self.emit(Event("hook", f"--on-publish {'ran' if ok else 'timed out' if done.status == 'timeout' else 'FAILED'}"
                        f" for {rec['name']}" + ("" if ok else f" ({done.error})"), rec["name"], rec.get("step"),
                        {"status": done.status, "exit_code": done.exit_code, "error": done.error,
                         "seconds": done.seconds}))

    # ---- retention ---------------------------------------------------------------------------
    def retain(self) -> None:
        for rec in to_remove(list(self.state.records.values()), self.opts.retention, verify=self.opts.verify):
            self.remove(rec)

    def remove(self, rec: dict[str, Any]) -> None:
        dest = Path(rec["dest"])
        if not still_ours(dest, rec):  # the cheap look first; remove_export checks what it moved
            self._released(rec, dest)
            return
        rec["status"] = "removing"
        self.state.put(rec, {"event": "removing"})
        if not remove_export(dest, rec, fsync=self.opts.export.fsync, command=f"{self.opts.command} [retention]"):
            self._released(rec, dest)
            return
        self._removed(rec)

    def _released(self, rec: dict[str, Any], dest: Path) -> None:
        rec["status"] = "released"
        self.state.put(rec, {"event": "released"})
        self.emit(Event("released", f"{dest} is no longer exactly the export published (replaced, or files "
                        "added or removed); left as it is", rec["name"], rec.get("step"), {"dest": str(dest)}))

    def _removed(self, rec: dict[str, Any]) -> None:
        rec.update(status="removed", removed_at=time.time())
        self.state.put(rec, {"event": "removed"})
        self.emit(Event("removed", f"removed {rec['dest']} (retention)", rec["name"], rec.get("step"),
                        {"dest": rec["dest"]}))

    # ---- a restart -----------------------------------------------------------------------------
    def resume(self) -> None:
        """Finish what a killed follower left: its publish (or forget an export that did not
        publish), its removal, its pending --on-publish command."""
        for rec in sorted(self.state.records.values(), key=lambda r: (r.get("step", -1), r["name"])):
            status = rec.get("status")
            if status == "exporting":
                if self.settle(rec):
                    self.emit(Event("recovered", f"{rec['name']}: the export a killed follower made is published",
                                    rec["name"], rec.get("step")))
                    self.published(rec, None)
            elif status == "removing":
                dest = Path(rec["dest"])
                from ckptctl.staging import recover_destination

                recover_destination(dest)  # the staging directory a killed removal left
                if still_ours(dest, rec) and not remove_export(
                        dest, rec, fsync=self.opts.export.fsync, command=f"{self.opts.command} [retention]"):
                    self._released(rec, dest)
                    continue
                self._removed(rec)
            elif status == "published" and (rec.get("on_publish") or {}).get("status") == "pending" \
                    and self.opts.on_publish:
                self.hook(rec)
