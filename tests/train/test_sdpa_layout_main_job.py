"""The main job sizes the packed cache from its data and, with the sdpa
backend, attends through the padded view where it computes fewer scores (item 2): the same
losses and gradient norms as the [T, T] mask layout, and the startup line says which."""

import pytest

from tests.support.cuda_as_cpu import cuda_as_cpu
from tests.support.hydra_compose import compose_job
from tests.support.main_job import train_in_process

from megatron_fastpath import _optional
from megatron_fastpath.train import parse_job_config
from megatron_fastpath.packed_seq import PackedSeqConfig
from megatron_fastpath.packed_seq.config import DEFAULT_SDPA_MASK_MAX_TOKENS, seqlen_bound

# T = 512, up to 8 sequences of 8..48 tokens: bound 64, 3 * 8 * 64^2 < 512^2 -> padded view
SMALL = ["training.steps=3", "data.num_samples=256", "data.max_len=48", "data.max_seqs=8",
         "model.num_layers=2",
         "model.hidden_size=64", "model.ffn_hidden_size=96", "metrics.wandb=off",
         "metrics.tensorboard=false", "metrics.plot=false"]


def _run(layout, capsys):
    job, summary = train_in_process(SMALL + [f"fastpath.sdpa_layout={layout}"], header=True)
    return job, summary, capsys.readouterr().out


def test_padded_view_trains_like_the_mask_layout(mcore_parallel, capsys):
    job_p, auto, out_p = _run("auto", capsys)
    job_m, mask, out_m = _run("mask", capsys)
    longest = max(int(mb.lengths.max()) for mb in job_p.data.bins)
    assert longest <= 48 and job_p.cache.config.max_seqlen == seqlen_bound(longest, 512) == 64
    assert job_p.cache.config.sdpa_padded and not job_m.cache.config.sdpa_padded
    assert "(sequences <= 64 tokens), attention sdpa (padded view)" in out_p
    assert "attention sdpa ([T, T] mask)" in out_m
    assert job_p.cache.stats.per_kind.get("sdpa_mask") is None
    for a, b in zip(auto.records, mask.records):
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)


@pytest.mark.parametrize("longest, expected", [(1, 64), (64, 64), (65, 128), (600, 512)])
def test_seqlen_bound_buckets(longest, expected):
    assert seqlen_bound(longest, 512) == expected


def test_bad_layout_refused_at_parse():
    with pytest.raises(ValueError, match="fastpath.sdpa_layout must be one of auto, mask, padded"):
        parse_job_config(compose_job(["fastpath.sdpa_layout=dense"]))


@pytest.mark.parametrize("layout, backend", [("auto", "sdpa"), ("padded", "sdpa"), ("mask", "flex")])
def test_auto_backend_above_the_mask_limit_stays_on_sdpa_unless_the_layout_is_the_mask(
        monkeypatch, layout, backend):
    """On CUDA without TE / flash-attn, attention_backend=auto above the [T, T] mask's limit
    (16384 tokens) picks flex only when fastpath.sdpa_layout is the mask: the padded view has no
    mask, and the limit binds the mask layout only (packed_seq.config.sdpa_max_tokens); auto's
    layout takes the padded view there, so sdpa serves it."""
    monkeypatch.setattr(_optional, "have", lambda name: False)  # no TE, no flash-attn
    t = 2 * DEFAULT_SDPA_MASK_MAX_TOKENS
    with cuda_as_cpu():
        job = parse_job_config(compose_job([
            "training.device=cuda", f"data.max_tokens={t}", f"fastpath.sdpa_layout={layout}",
            # the memory check reads the GPU's properties, which the CUDA-as-CPU mode has none of
            "training.skip_memory_check=true"]))
    assert job.device.type == "cuda" and job.attention_backend == backend
    # the cache the job builds (train/job.py build_cache, M = T at worst) attends as chosen
    cache = PackedSeqConfig(max_tokens=t, max_seqs=job.data.max_seqs, sdpa_layout=layout)
    assert cache.sdpa_padded is (backend == "sdpa")
