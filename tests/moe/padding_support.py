"""Helpers of the MoE padding tests (EP=1 in test_moe_padding.py, EP=2 in test_moe_ep_gloo.py):
a padding mask, one batch with two padding contents, one forward+backward, and the comparison
that real rows, losses and gradients are bit-identical."""

import torch

S, B = 12, 2
REAL_LENGTHS = (9, 5)  # real tokens of each row; the rest of the row is padding


def padding_mask_BS(lengths=REAL_LENGTHS, seq=S):
    """[B, S] bool, True = padding (Megatron's convention)."""
    return torch.arange(seq).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)


def two_paddings(x_SBH, pad_BS, router_w_EH):
    """The same batch with two padding contents: random, and one that every router scores
    highest for expert 0 (so routed padding would take expert 0's whole capacity)."""
    pad_SB1 = pad_BS.t().unsqueeze(-1)
    hot = 4.0 * router_w_EH[0] / router_w_EH[0].norm()
    a = torch.where(pad_SB1, torch.randn(x_SBH.shape), x_SBH)
    b = torch.where(pad_SB1, hot.expand(x_SBH.shape), x_SBH)
    return a, b


def run_layer(layer, x_SBH, pad_BS, g_SBH):
    """Forward + backward; returns outputs, input grad, parameter grads and the logged losses."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    clear_aux_losses_tracker()
    layer.zero_grad(set_to_none=True)
    x = x_SBH.clone().requires_grad_()
    out, _ = layer(x, padding_mask=pad_BS)
    (out * g_SBH).sum().backward()
    tracker = get_moe_layer_wise_logging_tracker()
    losses = {k: v["values"].clone() for k, v in tracker.items()}
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return dict(out=out.detach(), gx=x.grad, grads=grads, losses=losses)


def compare_runs(ra, rb, pad_BS, where=""):
    """Real rows, losses and parameter grads bit-identical; padding rows zero in both."""
    real_SB = ~pad_BS.t()
    for key in ("out", "gx"):
        diff = (ra[key][real_SB] - rb[key][real_SB]).abs().max()
        assert torch.equal(ra[key][real_SB], rb[key][real_SB]), f"{where}: real {key} differs by {diff}"
    assert set(ra["losses"]) == set(rb["losses"]) == {"load_balancing_loss", "z_loss"}, ra["losses"]
    for name in ra["losses"]:
        assert float(ra["losses"][name].abs().sum()) > 0, f"{where}: {name} not computed"
        assert torch.equal(ra["losses"][name], rb["losses"][name]), (
            f"{where}: {name} {ra['losses'][name]} != {rb['losses'][name]}")
    assert set(ra["grads"]) == set(rb["grads"])
    for name in ra["grads"]:
        diff = (ra["grads"][name] - rb["grads"][name]).abs().max()
        assert torch.equal(ra["grads"][name], rb["grads"][name]), f"{where}: grad {name} differs by {diff}"
    for r in (ra, rb):
        assert torch.count_nonzero(r["out"][~real_SB]) == 0, f"{where}: padding output not zero"
        assert torch.count_nonzero(r["gx"][~real_SB]) == 0, f"{where}: padding got a gradient"
