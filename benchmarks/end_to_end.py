"""One training step of the same tiny Llama on the same sequences, four ways.

Each side trains the same sequences (one packed batch of exactly T tokens: the last sequence
takes the remainder) with the same architecture (2 layers, hidden 256, GQA 4 heads / 2 groups,
SwiGLU 704, RMSNorm, RoPE, vocab 1024, fp32): forward, backward and a torch AdamW step, min over
repeats, all sides in one process, alternating.

``ours``
    ``get_fastpath_layer_spec(cache, backend="sdpa")`` on a ``GPTModel``, the packed cache with
    ``sdpa_layout=auto`` and ``max_seqlen`` from the data (``seqlen_bound``): the packed-to-padded
    view where it computes 4x fewer scores than the [T, T] mask, the mask otherwise.
``megatron_packed``
    Megatron-Core's local spec (``get_gpt_layer_local_spec``: ``DotProductAttention``), the
    packed [1, T] batch with a block-diagonal causal boolean mask [1, 1, T, T] and per-token RoPE
    angles (positions restart at each sequence): what stock Megatron runs packed without TE /
    flash (its local attention takes no ``PackedSeqParams``). Same weights as ``ours``.
``megatron_padded``
    The same local-spec model, batches padded to the longest sequence ([B, S_max], causal mask,
    padding out of the loss). Same weights as ``ours``.
``hf_padded``
    transformers' ``LlamaForCausalLM`` (``attn_implementation="sdpa"``), [B, S_max] with an
    attention mask; its own random weights (the time does not depend on the values).

RoPE for the two Megatron sides is computed per step with Megatron's ``RotaryEmbedding``
(``get_freqs_non_repeated``): ``GPTModel``'s own RoPE preprocessing moves ``inv_freq`` to CUDA in
0.16.1 (see ``benchmarks/packed_seq.py``). Counts beside the times: attention scores per layer
and head (T^2, S x M^2 or B x S_max^2) and the tokens each side computes (padding included).
Numerics: ``ours``, ``megatron_packed`` and ``megatron_padded`` share weights and must give the
same loss (relative difference printed).

Length mixes: ``sft`` (8..96 tokens, uniform, as the synthetic SFT data) and ``long_tail``
(log-normal, median 128, clipped to [8, 1024]).

    python benchmarks/end_to_end.py --json benchmarks/results/end_to_end.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_meter import LoadMeter, describe, publish  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 2, 256, 4, 2, 704, 1024
TOKENS = (512, 2048, 8192, 16384)
MIXES = ("sft", "long_tail")
# the [T, T] fp32 scores of one layer, times the copies autograd and softmax keep: megatron_packed
# is skipped above this T (about 4 GiB of scores per layer at 16384 on a 24 GiB machine)
MEGATRON_PACKED_MAX_T = 8192


def lengths_for(mix: str, t: int, seed: int = 0) -> list:
    """Sequences filling exactly ``t`` tokens (greedy; the last one takes the remainder)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < t:
        if mix == "sft":
            n = int(rng.integers(8, 97))
        else:
            n = int(np.clip(rng.lognormal(np.log(128), 1.0), 8, min(1024, t)))
        n = min(n, t - total)
        out.append(n)
        total += n
    return out


def _model_config():
    from megatron_fastpath.model import ModelConfig

    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                       num_query_groups=GROUPS, ffn_hidden_size=FFN, vocab_size=VOCAB)


def build_sides(t: int, lengths: list, skip_packed: bool, layout: str = "auto") -> dict:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_fastpath.layer_spec import get_fastpath_layer_spec
    from megatron_fastpath.model import build_gpt_model, build_transformer_config, rope_config_for
    from megatron_fastpath.packed_seq import PackedSeqCache, PackedSeqConfig
    from megatron_fastpath.packed_seq.config import seqlen_bound

    mcfg = _model_config()
    tcfg = build_transformer_config(mcfg)
    cache = PackedSeqCache(PackedSeqConfig(
        max_tokens=t, max_seqs=len(lengths), max_seqlen=seqlen_bound(max(lengths), t),
        rope=rope_config_for(mcfg), sdpa_layout=layout))
    torch.manual_seed(0)
    ours = build_gpt_model(tcfg, get_fastpath_layer_spec(cache, backend="sdpa"), VOCAB, t)
    locals_ = []
    for _ in range(2):  # megatron_packed, megatron_padded
        local = build_gpt_model(tcfg, get_gpt_layer_local_spec(normalization="RMSNorm"), VOCAB, t)
        res = local.load_state_dict(ours.state_dict(), strict=False)
        if res.unexpected_keys or any("_extra_state" not in k for k in res.missing_keys):
            raise RuntimeError(f"weights do not transfer to the local spec: {res}")
        locals_.append(local)
    rotary = RotaryEmbedding(kv_channels=tcfg.kv_channels, rotary_percent=mcfg.rotary_percent,
                             rotary_base=mcfg.rotary_base, use_cpu_initialization=True)
    sides = {"ours": ours, "megatron_packed": locals_[0], "megatron_padded": locals_[1]}
    if skip_packed:
        del sides["megatron_packed"]
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=t,
        rope_theta=mcfg.rotary_base, tie_word_embeddings=False, attn_implementation="sdpa"))
    sides["hf_padded"] = hf
    return dict(sides=sides, cache=cache, rotary=rotary)


def cpu_scores_buffer(numel: int) -> None:
    """Megatron's local ``DotProductAttention`` computes its scores into
    ``parallel_state.get_global_memory_buffer().get_tensor(..., "mpu")``, which allocates on
    ``torch.cuda.current_device()`` when the buffer is missing or too small (core/utils.py
    ``GlobalMemoryBuffer.get_tensor``). A CPU buffer of ``numel`` floats put there first is
    reused (a view of it), so the stock local attention runs on a CPU unchanged."""
    from megatron.core import parallel_state

    buf = parallel_state.get_global_memory_buffer().buffer
    key = ("mpu", torch.float32)
    if key not in buf or buf[key].numel() < numel:
        buf[key] = torch.empty(numel, dtype=torch.float32)


class _NoDropoutRngTracker:
    """Megatron's local ``DotProductAttention`` forks the CUDA RNG tracker around its attention
    dropout (dot_product_attention.py), and the tracker's fork reads and sets the CUDA
    generator. Dropout is 0 here (``build_transformer_config``), so the fork has nothing to do:
    this benchmark-only tracker's fork is empty, and it is installed as Megatron's tracker
    (``tensor_parallel.random._CUDA_RNG_STATE_TRACKER``) before the stock side runs."""

    def fork(self, name: str = "model-parallel-rng"):
        import contextlib

        return contextlib.nullcontext()


def use_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random._CUDA_RNG_STATE_TRACKER = _NoDropoutRngTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _freqs(rotary, n: int) -> torch.Tensor:
    f = rotary.get_freqs_non_repeated(n)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def _batches(lengths: list, tokens_T: torch.Tensor):
    """Packed [1, T] tokens / labels and padded [B, S_max] ones (labels: next token within the
    sequence; the last token of each sequence and padding out of the loss)."""
    t, b, s = int(tokens_T.numel()), len(lengths), max(lengths)
    labels_T = torch.full((t,), -100, dtype=torch.long)
    pad_tok = torch.zeros(b, s, dtype=torch.long)
    pad_lab = torch.full((b, s), -100, dtype=torch.long)
    pad_mask = torch.zeros(b, s, dtype=torch.long)
    pos_T = torch.empty(t, dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        seq = tokens_T[start:start + n]
        labels_T[start:start + n - 1] = seq[1:]
        pos_T[start:start + n] = torch.arange(n)
        pad_tok[i, :n] = seq
        pad_lab[i, :n - 1] = seq[1:]
        pad_mask[i, :n] = 1
        start += n
    return dict(tok_1T=tokens_T[None], lab_1T=labels_T[None], pos_T=pos_T, tok_BS=pad_tok,
                lab_BS=pad_lab, mask_BS=pad_mask)


def _block_causal_mask(lengths: list, t: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True where a query may NOT attend (Megatron's convention)."""
    seq_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (seq_T[:, None] == seq_T[None, :]) & (pos[:, None] >= pos[None, :])
    return (~allowed)[None, None]


def _megatron_loss(model, tok, lab, attention_mask, rotary_pos_emb, packed_seq_params=None):
    hidden = model.embedding(input_ids=tok, position_ids=None)
    hidden = model.decoder(hidden_states=hidden, attention_mask=attention_mask,
                           rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
    logits, _ = model.output_layer(hidden)  # [S, B, V]
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB).float(), lab.reshape(-1),
                           ignore_index=-100)


def make_step(name: str, built: dict, lengths: list, data: dict):
    """A closure running one forward + backward and returning the loss (a float)."""
    model, cache, rotary = built["sides"][name], built["cache"], built["rotary"]
    if name == "ours":
        def step():
            with cache.batch(lengths) as pb:
                loss = _megatron_loss(model, data["tok_1T"], data["lab_1T"], None, None,
                                      pb.packed_seq_params)
                loss.backward()
            return loss
    elif name == "megatron_packed":
        mask = _block_causal_mask(lengths, data["tok_1T"].shape[1])
        freqs = _freqs(rotary, max(lengths))

        def step():
            loss = _megatron_loss(model, data["tok_1T"], data["lab_1T"], mask, freqs[data["pos_T"]])
            loss.backward()
            return loss
    elif name == "megatron_padded":
        freqs = _freqs(rotary, max(lengths))
        # the causal mask Megatron builds itself when handed none (transformer/utils.py
        # get_default_causal_mask: on "cuda", hence given here)
        causal = torch.triu(torch.ones(max(lengths), max(lengths)), diagonal=1).bool()[None, None]

        def step():
            loss = _megatron_loss(model, data["tok_BS"], data["lab_BS"], causal, freqs)
            loss.backward()
            return loss
    else:
        def step():
            logits = model(input_ids=data["tok_BS"], attention_mask=data["mask_BS"]).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), data["lab_BS"].reshape(-1),
                                   ignore_index=-100)
            loss.backward()
            return loss
    return step


def measure(t: int, mix: str, reps: int, layout: str = "auto") -> dict:
    lengths = lengths_for(mix, t)
    skip_packed = t > MEGATRON_PACKED_MAX_T
    built = build_sides(t, lengths, skip_packed, layout)
    g = torch.Generator().manual_seed(1)
    data = _batches(lengths, torch.randint(0, VOCAB, (t,), generator=g))
    names = list(built["sides"])
    b, s = len(lengths), max(lengths)
    cpu_scores_buffer(max(HEADS * b * s * s, HEADS * t * t if not skip_packed else 0))
    opts = {n: torch.optim.AdamW(built["sides"][n].parameters(), lr=1e-4, foreach=True) for n in names}
    steps = {n: make_step(n, built, lengths, data) for n in names}
    losses, times = {}, {n: [] for n in names}
    for r in range(reps + 1):  # round 0: warm-up and numerics (before any optimizer step)
        for n in names:
            model = built["sides"][n]
            for p in model.parameters():
                p.grad = None
            gc.collect()
            t0 = time.perf_counter()
            loss = steps[n]()
            opts[n].step()  # round 0 too: AdamW's state is allocated outside the timed rounds
            dt = time.perf_counter() - t0
            if r == 0:
                losses[n] = float(loss)
            else:
                times[n].append(dt * 1e3)
    from megatron_fastpath.packed_seq.config import seqlen_bound

    m = seqlen_bound(s, t)
    padded_view = built["cache"].config.sdpa_padded  # the layout ours ran
    row = dict(tokens=t, mix=mix, sequences=b, longest=s,
               ours_layout="padded view" if padded_view else "mask")
    times = {n: [round(x, 1) for x in v] for n, v in times.items()}  # as the JSON keeps them
    for n in ("ours", "megatron_packed", "megatron_padded", "hf_padded"):
        row[f"{n}_ms"] = min(times[n]) if n in times else None
    peers = {n: row[f"{n}_ms"] for n in ("megatron_packed", "megatron_padded", "hf_padded")
             if row[f"{n}_ms"] is not None}
    fastest = min(peers, key=peers.get)
    row["fastest_peer"] = fastest
    row["fastest_peer_over_ours"] = round(peers[fastest] / row["ours_ms"], 2)
    row["verdict"] = verdict(times["ours"], times[fastest])
    row["times_ms"] = times
    row["scores_ours"] = b * m * m if padded_view else t * t
    row["scores_packed_mask"] = t * t
    row["scores_padded"] = b * s * s
    row["tokens_padded"] = b * s
    ref = losses["ours"]
    row["loss_rel_diff_megatron"] = max(abs(losses[n] - ref) / abs(ref) for n in losses
                                        if n.startswith("megatron"))
    return row


def spread(times_ms: list) -> float:
    """Median minus minimum of a side's timed steps: how far repeats of one side move."""
    return float(np.median(times_ms)) - min(times_ms)


def verdict(ours_ms: list, peer_ms: list) -> str:
    """"ours faster" / "peer faster", or "tie within noise" when the two minimums are closer
    than either side's min-to-median spread (a rerun flips such verdicts)."""
    gap = min(peer_ms) - min(ours_ms)
    if abs(gap) <= max(spread(ours_ms), spread(peer_ms)):
        return "tie within noise"
    return "ours faster" if gap > 0 else "peer faster"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="timed steps per side (minimum taken)")
    p.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    p.add_argument("--mixes", nargs="*", default=list(MIXES), choices=MIXES)
    p.add_argument("--ours-layout", default="auto", choices=("auto", "mask", "padded"),
                   help="fastpath.sdpa_layout of ours (auto: the rule the main job applies)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from megatron_fastpath.distributed import init_distributed

    init_distributed(backend="gloo")  # a 1-process group: Megatron's modules read parallel state
    use_cpu_rng_tracker()
    with LoadMeter() as meter:
        rows = [measure(t, mix, args.reps, args.ours_layout) for t in args.tokens for mix in args.mixes]
    env = dict(torch=torch.__version__, threads=torch.get_num_threads(), **meter.report())
    keys = [k for k in rows[0] if k != "times_ms"]
    text = "\n".join(["  ".join(keys)] + ["  ".join(str(r[k]) for k in keys) for r in rows] + [
        "", "ms: one step (forward + backward + AdamW), minimum over repeats; "
        "fastest_peer_over_ours = the fastest peer's time / ours (> 1: ours is faster); "
        "verdict: a tie within noise when the minimums differ by less than either side's "
        "min-to-median spread; "
        "scores = attention scores per layer and head; megatron_packed is not run above "
        f"T = {MEGATRON_PACKED_MAX_T} (its [T, T] scores)", describe(env)])
    return publish(args, env, rows, text)


if __name__ == "__main__":
    main()
