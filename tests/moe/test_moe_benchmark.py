"""benchmarks/moe_dispatch.py in a tiny configuration: JSON schema, exact host-sync counts per
variant, and ours' aten op count independent of the number of experts."""

import json
import os
import subprocess
import sys

from megatron_fastpath.train import config_dir

REPO = os.path.dirname(config_dir())


def test_moe_benchmark_quick_json(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, f"{REPO}/benchmarks/moe_dispatch.py", "--tokens", "256", "--hidden", "64",
         "--experts", "8", "32", "--topk", "2", "--reps", "1", "--warmup", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    keys = {"variant", "experts", "topk", "host_syncs_per_layer", "aten_ops", "fwd_ms", "fwd_bwd_ms"}
    assert all(keys <= r.keys() for r in rows)
    by = {(r["variant"], r["experts"]): r for r in rows}
    for E in (8, 32):
        assert by[("d_fastpath_sortcount", E)]["host_syncs_per_layer"] == 0
        assert by[("a2_where_loop_index_select", E)]["host_syncs_per_layer"] == E
        assert by[("a_hf_where_loop", E)]["host_syncs_per_layer"] >= E
        assert by[("b_unsloth_bincount", E)]["host_syncs_per_layer"] == 2
        assert by[("c_megatron_permute", E)]["host_syncs_per_layer"] == 3
        assert all(by[(v, E)]["fwd_bwd_ms"] > 0 for v, _ in by)
    assert by[("d_fastpath_sortcount", 8)]["aten_ops"] == by[("d_fastpath_sortcount", 32)]["aten_ops"]
    assert by[("a_hf_where_loop", 32)]["aten_ops"] > by[("a_hf_where_loop", 8)]["aten_ops"]
    assert "(a)/ours fwd+bwd" in proc.stdout
