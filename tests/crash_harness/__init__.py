"""Crash harness: kill ``export --overwrite`` / ``resave`` at every phase and at random moments,
then prove the invariants of DESIGN.md section 1 on what is left.

Shared by the fast campaign in ``tests/test_crash_campaign.py`` and the long mode
``python -m bench.crash_campaign`` (hundreds of kills); both import ``tests.crash_harness`` from
the repository root, with no ``sys.path`` manipulation. Nothing is mocked: the command runs in a real
process that is SIGKILLed (by itself at a named fault point, ``CKPTCTL_KILL_AT``, or by us after a
random delay), on the real filesystem, with fsync on.

One trial (:func:`run_trial`):

1. a fresh workspace from the scenario's template: ``src/`` (export only) and ``ws/`` holding the
   destination ``ws/ckpt`` (the *old* version: weights, config.json, README.md, usually a
   manifest), a bystander checkpoint ``ws/other`` and a foreign ``_tmp_`` directory without an owner
   record (``ws/_tmp_ckpt.0000000000000001-00000000``, what another tool could leave; gc-tmp must
   keep it);
2. the command, killed at the fault;
3. **I1**: ``ws/ckpt`` is byte for byte the old version or the new one (the new one = what a clean
   run of the same command produces, manifest compared without its ``created`` stamp); the version
   found verifies clean (``ckptctl.verify``) and three loaders (glob, index-first, single-first) all
   load exactly its tensors. Only the exchange-less fallback has a window with no destination;
   then ``ready``/``old/`` must be there for gc-tmp to roll it forward or back;
   **I2**: a manifest lists every file with its exact size and sha256, and the index's
   ``weight_map`` equals the union of the shard headers;
4. **I4**: every leftover is a staging directory attributable to this destination (name + owner
   record); ``gc-tmp ws --min-age 0`` removes all of them and changes nothing else in ``ws``
   (or, in ``recovery="rerun"`` trials, the next run of the command cleans them up itself);
5. **I8**: the same command again exits 0 and leaves bytes identical to the clean run.

The outcome of each trial is a :class:`Outcome`; ``violations`` is empty when every check held.

Modules: :mod:`.scenarios` (old versions, sources, commands, fault points, :class:`Prepared`),
:mod:`.trial` (one kill and its checks), :mod:`.errno_trial` (injected errors, no kill),
:mod:`.observe` (staging leftovers, attribution, the I1/I2 checks), :mod:`.poller` (a reader
during publishes), :mod:`.tables` (the summary tables). The processes are run by
``tests.support``'s runners: :class:`ZygoteRunner` (forked from a warm interpreter) and
:class:`ExecRunner` (a fresh ``python -m ckptctl``).
"""

from tests.crash_harness.errno_trial import ERRNO_PHASES, ERRNO_WORDS, ErrnoOutcome, errno_faults, run_errno_trial
from tests.crash_harness.observe import (DECOY, DEST, attributable, check_marker, check_version, header_names,
                                         infer_phase, is_stub, our_staging, snapshot, wait_for_staging)
from tests.crash_harness.poller import PollStats, Poller, ViewError, dir_signature, view_signature
from tests.crash_harness.scenarios import (ALL_POINTS, EINVAL, PUBLISHED_POINTS, SCENARIOS, Prepared, Scenario,
                                           model_state)
from tests.crash_harness.tables import (OUTCOME_COLUMNS, campaign_report, markdown_rows, markdown_table, summarize,
                                        summarize_errno)
from tests.crash_harness.trial import Fault, Outcome, classify, random_fault, run_trial
from tests.support.cli import ExecRunner, Result
from tests.support.zygote import ZygoteRunner

__all__ = [
    "ALL_POINTS", "DECOY", "DEST", "EINVAL", "ERRNO_PHASES", "ERRNO_WORDS", "OUTCOME_COLUMNS", "PUBLISHED_POINTS",
    "SCENARIOS", "ErrnoOutcome", "ExecRunner", "Fault", "Outcome", "PollStats", "Poller", "Prepared", "Result",
    "Scenario", "ViewError", "ZygoteRunner", "attributable", "campaign_report", "check_marker", "check_version", "classify",
    "dir_signature", "errno_faults", "header_names", "infer_phase", "is_stub", "markdown_rows", "markdown_table",
    "model_state", "our_staging", "random_fault", "run_errno_trial", "run_trial", "snapshot", "summarize",
    "summarize_errno", "view_signature", "wait_for_staging",
]
