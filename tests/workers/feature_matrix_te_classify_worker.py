"""The TE world's classifier, in a process where the fake TE is importable:
``python -m tests.workers.feature_matrix_te_classify_worker --classify-te OUT`` (``matrix.classify_te_world_in_child``)."""

import json
import sys
from pathlib import Path

from tests.support.fake_te.activate import activate

assert sys.argv[1] == "--classify-te", sys.argv
activate()  # before Megatron is imported (the matrix imports it lazily): HAVE_TE at import

from tests.train.feature_matrix.matrix import classify_world, encode_verdicts  # noqa: E402

Path(sys.argv[2]).write_text(json.dumps(encode_verdicts(classify_world(True))), encoding="utf-8")
