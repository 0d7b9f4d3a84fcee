"""The workflow code's version: the replay baseline and the patches added since.

Version 1 is the baseline: the recorded histories in tests/histories/ were all made by it, and
the workflow code holds no ``workflow.patched`` branch (docs/workflow-versioning.md). The next
change that alters the commands a running ``TrainingRun``, ``RLStep`` or ``SFTStep`` emits
follows one of two roads, named here so a reader finds every live one:

- a patch: ``if workflow.patched(ID)`` around the new path, ``ID`` appended to ``PATCHES``, a
  recording of the new path added (the old recordings keep replaying the old one); once no
  run that lacks the patch can still be open (the retention of the runs started before it has
  passed), ``workflow.deprecate_patch(ID)`` replaces the branch, and a later release removes it
  and its id;
- a new workflow type (``RLStepV2``), when the change is too large for a branch: runs started
  before keep the old type until they close, then it is deleted.
"""

from __future__ import annotations

BASELINE = 1  # the workflow code version that recorded tests/histories/
PATCHES: tuple[str, ...] = ()  # ``workflow.patched`` ids added after the baseline, oldest first
