"""A child of ``test_hook_feature_matrix_child_runs``: ``python -m tests.workers.hook_matrix_worker run
KEY SPEC OUT`` (``matrix._run_child``)."""

import sys

from tests.integrations.hook_feature_matrix.matrix import RUN_STATUSES, _run_child

# (a positional first word: torchrun takes an abbreviated "--run" for its own --run-path)
assert sys.argv[1] == "run" and sys.argv[2] in RUN_STATUSES.values(), sys.argv
if sys.argv[2].endswith("-te"):
    from tests.support.fake_te.activate import activate

    activate()  # before Megatron is imported (the matrix imports it lazily): HAVE_TE at import
_run_child(*sys.argv[2:5])
