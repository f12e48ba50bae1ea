"""benchmarks/dp_optimizer.py's quick mode (the main job at DP 2 under torchrun, gloo, the GPU
stand-ins; 2 layers, hidden 64; plain, distributed, distributed with overlap and 4096-element
buckets): the collectives each steady-state step issues, counted at torch.ops.c10d, equal the
figures DDP's buffers give, exactly -- plain: one all-reduce of 4 B x every trainable parameter;
distributed: one reduce-scatter and one all-gather per bucket, each of 4 B x the buffer's
elements (the parameters plus Megatron's alignment padding), the same wire bytes per rank as the
all-reduce but for that padding and the two scalars over the DP group (the gradient norm's
squared shard norms, the loss); the Adam moments per rank halved. In bf16 the gradients are
reduced in fp32 and the bf16 parameters gathered: the distributed optimizer sends 3/4 of the
plain all-reduce's bytes, and the fp32 main parameters are sharded too. No time is asserted (the
machine may be busy). Integration tier: one torchrun launch of five main-job runs (~40 s)."""

import pytest


@pytest.fixture(scope="module")
def rows():
    import dp_optimizer

    return {(r["variant"] if r["model"] == "full" else f"{r['model']} {r['variant']}"): r
            for r in dp_optimizer.main(["--quick"])["results"]}


def _bulk(r, kind):
    return r["collectives_per_step"]["bulk"].get(kind, {"count": 0, "bytes": 0})


@pytest.mark.integration
def test_plain_data_parallel_all_reduces_every_gradient_once(rows):
    r = rows["plain"]
    params = r["trainable_params"]
    assert r["buffer_elements"] == params and r["buckets"] == 1
    assert _bulk(r, "all_reduce") == {"count": 1, "bytes": 4 * params}
    assert _bulk(r, "reduce_scatter")["count"] == _bulk(r, "all_gather")["count"] == 0
    # the loss over the DP group; the gradient norm's all-reduce runs on the model-parallel
    # group (whole gradients on every rank): one rank at TP 1, nothing moves
    assert r["collectives_per_step"]["group_of_one"]["all_reduce"]["count"] >= 1
    assert r["collectives_per_step"]["scalars"] == {"all_reduce": {"count": 1, "bytes": 4}}
    assert r["wire_bytes_per_step"] == 4 * params + 4
    assert r["optimizer_state_bytes"] == [8 * params, 8 * params]  # Adam's two moments, whole
    assert r["updated_elements"] == [params, params]
    assert r["main_param_bytes"] == [0, 0]  # fp32: the optimizer steps the model's parameters
    assert r["bulk_equals_expected"]


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["dist", "dist-overlap"])
def test_distributed_optimizer_reduce_scatters_and_gathers_each_bucket(rows, variant):
    r, plain = rows[variant], rows["plain"]
    params, elements, buckets = r["trainable_params"], r["buffer_elements"], r["buckets"]
    assert params == plain["trainable_params"]
    assert r["buffer_padding"] == elements - params >= 0
    assert buckets == (1 if variant == "dist" else 10)
    assert _bulk(r, "reduce_scatter") == _bulk(r, "all_gather") == {"count": buckets,
                                                                    "bytes": 4 * elements}
    assert _bulk(r, "all_reduce")["count"] == 0
    # the gradient norm (squared shard norms summed) and the loss, over the DP group
    assert r["collectives_per_step"]["scalars"] == {"all_reduce": {"count": 2, "bytes": 8}}
    # a ring at DP 2: half of each reduce-scatter and all-gather, the whole of an all-reduce
    assert r["wire_bytes_per_step"] == 4 * elements + 8
    assert r["wire_bytes_per_step"] - plain["wire_bytes_per_step"] == 4 * r["buffer_padding"] + 4
    # each rank's Adam moments cover its shard; the shards split the parameters
    assert sum(r["updated_elements"]) == params and min(r["updated_elements"]) > 0
    assert r["optimizer_state_bytes"] == [8 * n for n in r["updated_elements"]]
    assert r["main_param_bytes"] == [0, 0]  # fp32: the shards are views of the param buffer
    assert r["bulk_equals_expected"]
    assert (r["overlap_grad_reduce"], r["overlap_param_gather"]) == ((variant == "dist-overlap",) * 2)


@pytest.mark.integration
def test_bf16_distributed_optimizer_gathers_bf16_parameters(rows):
    plain, dist = rows["full-bf16 plain"], rows["full-bf16 dist"]
    params, elements = plain["trainable_params"], dist["buffer_elements"]
    # the gradients reduced in fp32 either way (grad_reduce_in_fp32)
    assert _bulk(plain, "all_reduce") == {"count": 1, "bytes": 4 * params}
    assert _bulk(dist, "reduce_scatter") == {"count": 1, "bytes": 4 * elements}
    assert _bulk(dist, "all_gather") == {"count": 1, "bytes": 2 * elements}  # bf16 parameters
    # a ring at DP 2: 2 B + 1 B per element against the all-reduce's 4 B
    assert plain["wire_bytes_per_step"] == 4 * params + 4
    assert dist["wire_bytes_per_step"] == 3 * elements + 8
    # fp32 main parameters and Adam's moments: whole on each plain rank, the shard's on each
    assert plain["main_param_bytes"] == [4 * params] * 2
    assert plain["optimizer_state_bytes"] == [8 * params] * 2
    assert dist["main_param_bytes"] == [4 * n for n in dist["updated_elements"]]
    assert dist["optimizer_state_bytes"] == [8 * n for n in dist["updated_elements"]]
    assert sum(dist["updated_elements"]) == params
    assert plain["bulk_equals_expected"] and dist["bulk_equals_expected"]
