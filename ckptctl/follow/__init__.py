"""``ckptctl export SAVE_DIR DST_ROOT --follow``: publish an HF export of every completed save of a
running training job, with retention, restarts and a trainer that deletes behind it.

Modules: ``saves`` (the saves a directory holds, by step; their fingerprints), ``completion``
(when a save is complete, per kind; its identity), ``state`` (the records in
``DST_ROOT/.ckptctl-follow/`` and the one-follower lock), ``export`` (one save exported, pinned to
its files), ``handle`` (record, export, settle, verify, ``--on-publish``, retention of one
save), ``hook`` (the ``--on-publish`` command, in its own process group, with a timeout),
``retention`` (the keep rules and the removal of an export of ours), ``loop`` (the follower),
``metacache`` (a waiting save's ``.metadata`` parsed once per version), ``view`` (what a follower has done, read for ``inspect DST_ROOT``), ``priority`` (low CPU and I/O
priority), ``events`` (what it reports), ``options`` and ``choices`` (the fixed sets of values
``--from`` and ``--priority`` take). docs/FOLLOW.md describes the whole. Nothing here prints:
events go to a callback.

This package imports nothing itself: ``from ckptctl.follow.loop import follow`` loads what following
needs, ``ckptctl.follow.choices`` (the CLI's option types, loaded by ``ckptctl --help``) nothing else.
"""
