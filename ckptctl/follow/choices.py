"""The fixed sets of values the follower's options take, each one list (the CLI makes its choice
types from them: shown in ``--help``, completed by every shell). Imports nothing: ``export``'s
options are built from it on every ``ckptctl export`` and ``ckptctl --help``."""

FROM_CHOICES = ("newest", "all")  # --from: the saves already there when following begins
PRIORITY_CHOICES = ("low", "normal")  # --priority: the follower's CPU and I/O priority
