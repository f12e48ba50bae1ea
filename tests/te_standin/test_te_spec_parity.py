"""Megatron's Transformer Engine GPT layer spec on the fake TE (``tests/support/fake_te``)
computes what Megatron's local spec computes: the tiny GPT built with ``linear_impl=te``
(``TELayerNormColumnParallelLinear`` / ``TERowParallelLinear``, the fused input / pre-MLP norms,
TE norms for q/k) from the local model's weights, moved into TE's layout, gives the same
logits, loss and gradients in float32. The local run happens in a process without TE, the TE run
in one with the fake (``tests/workers/te_spec_worker.py``): Megatron picks its norms by ``HAVE_TE`` at import."""

import subprocess
import sys

import pytest
import torch

from tests.support.fake_te.activate import te_env
from tests.support.main_job import REPO, job_env

pytestmark = pytest.mark.integration


def _worker(*args):
    env = te_env() if args[0] == "te" else job_env()  # the local run: no TE at all
    proc = subprocess.run([sys.executable, "-m", "tests.workers.te_spec_worker", *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("variant", ["rmsnorm", "layernorm_bias_qknorm"])
def test_te_spec_equals_local_spec(tmp_path, variant):
    local, te = tmp_path / "local.pt", tmp_path / "te.pt"
    _worker("local", variant, local)
    _worker("te", variant, local, te)
    a, b = torch.load(local), torch.load(te)
    assert a["HAVE_TE"] is False and b["HAVE_TE"] is True
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear"} <= set(b["types"])
    assert "RowParallelLinear" not in b["types"]  # (the output layer is Megatron's column linear)
    torch.testing.assert_close(b["logits"], a["logits"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-6, atol=1e-6)
    assert b["grads_local_names"].keys() == a["grads"].keys()
    for k, g in a["grads"].items():
        torch.testing.assert_close(b["grads_local_names"][k], g, rtol=1e-5, atol=1e-6, msg=k)
