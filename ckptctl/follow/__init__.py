"""``ckptctl export SAVE_DIR DST_ROOT --follow``: publish an HF export of every completed save of a
running training job, with retention, restarts and a trainer that deletes behind it.

Modules: ``saves`` (the saves a directory holds, by step; their fingerprints), ``completion``
(when a save is complete, per kind; its identity), ``state`` (the records in
``DST_ROOT/.ckptctl-follow/`` and the one-follower lock), ``export`` (one save exported, pinned to
its files), ``handle`` (record, export, settle, verify, ``--on-publish``, retention of one
save), ``retention`` (the keep rules and the removal of an export of ours), ``loop`` (the
follower), ``priority`` (low CPU and I/O priority), ``events`` (what it reports), ``options``.
docs/FOLLOW.md describes the whole. Nothing here prints: events go to a callback.
"""

from ckptctl.follow.events import Event
from ckptctl.follow.loop import Follower, follow
from ckptctl.follow.options import FollowOptions
from ckptctl.follow.retention import Retention

__all__ = ["Event", "FollowOptions", "Follower", "Retention", "follow"]
