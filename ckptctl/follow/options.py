"""What a follower is asked to do (``ckptctl export SAVE_DIR DST_ROOT --follow ...``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptctl.errors import UsageError
from ckptctl.follow.choices import FROM_CHOICES
from ckptctl.follow.retention import Retention
from ckptctl.write.options import ExportOptions


@dataclass
class FollowOptions:
    source: Path  # the followed directory (absolute)
    dst_root: Path  # where each save is published as DST_ROOT/<its name> (absolute)
    export: ExportOptions = field(default_factory=ExportOptions)  # as for one export (overwrite is the follower's)
    key: str | None = None
    only: str | None = None
    start_from: str = "newest"  # newest | all: the saves already there when following begins
    quiet: float = 30.0  # seconds of nothing changing before a save counts as complete
    poll: float = 1.0  # seconds between two looks
    once: bool = False
    exit_when_idle: float | None = None  # seconds
    retention: Retention = field(default_factory=Retention)
    verify: bool = False
    on_publish: list[str] | None = None  # argv; the published path is appended
    hook_timeout: float = 3600.0  # --on-publish-timeout, seconds (follow/hook.py DEFAULT_TIMEOUT)
    low_priority: bool = True
    command: str = "ckptctl export --follow"

    def check(self) -> None:
        """Validate before anything is touched (UsageError, exit 2)."""
        if self.start_from not in FROM_CHOICES:
            raise UsageError(f"unknown --from {self.start_from!r}", "use --from newest or --from all")
        if self.quiet < 0:
            raise UsageError("--quiet-period cannot be negative", "e.g. --quiet-period 30s")
        if not self.poll > 0:
            raise UsageError("--poll-interval must be positive", "e.g. --poll-interval 5s")
        if self.once and self.exit_when_idle is not None:
            raise UsageError("--once and --exit-when-idle both say when to stop", "pass one of them")
        if self.on_publish is not None and not self.on_publish:
            raise UsageError("--on-publish is empty", "pass a command, e.g. --on-publish 'upload.sh --repo x'")
        if not self.hook_timeout > 0:
            raise UsageError("--on-publish-timeout must be positive", "e.g. --on-publish-timeout 30m")
        if self.export.dry_run:
            raise UsageError("--dry-run does not apply to --follow", "run `ckptctl export SAVE DST --dry-run` on one save")
        src, dst = self.source, self.dst_root
        if not src.is_dir():
            raise UsageError(f"{src} is not a directory", "pass the trainer's output (or --save) directory")
        if src == dst or dst.is_relative_to(src) or src.is_relative_to(dst):
            raise UsageError(f"DST_ROOT {dst} must be outside SAVE_DIR {src} and not hold it",
                             "pick a DST_ROOT beside the training output")
