"""What the follower reports: one :class:`Event` per thing that happened (the CLI prints one line
per event on stderr, or one JSON document per event with ``--json``).

=============  ====================================================================================
event          when
=============  ====================================================================================
start          following began (``resumed``: records found from an earlier follower)
waiting        a save is not complete yet (``reason``); said again only when the reason changes
skipped        a save older than what was there when following began (``--from newest``)
exporting      an export of a complete save begins
published      it is published at ``dest`` (``verified``: with ``--verify``, whether it verified clean)
lost           the save changed or was deleted while exported, or before its turn: nothing published
refused        the export refused the save (``error``), or ``dest`` holds a directory not ours
hook           the ``--on-publish`` command ended (``status``: ok, failed, timeout; ``exit_code``)
removed        retention removed an export of ours (``dest``)
released       an export of ours was replaced or removed by someone else: never touched again
recovered      a restart finished what a killed follower left (a publish it made, a removal)
warning        something the follower could not do that does not stop it (priority)
idle           ``--exit-when-idle``: nothing happened for that long; the follower exits
done           ``--once``: the pass is over
stopped        SIGTERM/SIGHUP/Ctrl-C: the follower stopped (a running export was cleaned up)
=============  ====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Event:
    event: str
    message: str
    name: str | None = None  # the save's name
    step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "name": self.name, "step": self.step, "message": self.message, **self.fields}


EmitFn = Callable[[Event], None]
