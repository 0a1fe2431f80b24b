"""Every connection-walk diagnostic of a small causal transformer, computed by hand with connmon.functional.

A 4-layer stack of torch.nn.MultiheadAttention blocks with random weights reads random embeddings. For each layer
the script reads the attention maps and the value/output projections, checks that the connection walk rebuilds
the layer's output exactly (the paper's identity: MHA output = M(X) + c), and prints the diagnostics of
DESIGN section 1. It then nudges every weight as one optimizer step would and prints the time drift.

    python examples/diagnose_attention.py

Runs in a few seconds on a CPU; no downloads.
"""

from __future__ import annotations

import torch
from torch import nn

import connmon.functional as F

torch.manual_seed(0)
N_TOKENS, WIDTH, HEADS, LAYERS = 32, 64, 4, 4
HEAD_WIDTH = WIDTH // HEADS


def read_layer(mha: nn.MultiheadAttention, x: torch.Tensor, causal: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's attention, logits, per-head value/output maps and bias constant, for one sequence x (n, d)."""
    w_q, w_k, w_v = mha.in_proj_weight.detach().clone().chunk(3)  # a copy: the weights change later
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
    q = (x @ w_q.T + b_q).view(N_TOKENS, HEADS, HEAD_WIDTH).transpose(0, 1)  # (H, n, d_h)
    k = (x @ w_k.T + b_k).view(N_TOKENS, HEADS, HEAD_WIDTH).transpose(0, 1)  # (H, n, d_h)
    logits = (q @ k.mT / HEAD_WIDTH**0.5).masked_fill(~causal, float("-inf"))  # (H, n, n)
    w_o = mha.out_proj.weight.detach().clone().view(WIDTH, HEADS, HEAD_WIDTH).transpose(0, 1)  # (H, d, d_h): O_h
    bias = (w_o @ b_v.view(HEADS, HEAD_WIDTH, 1)).sum(0).squeeze(-1) + mha.out_proj.bias  # c = sum_h O_h b_v + b_o
    return {
        "attn": logits.softmax(-1),
        "logits": logits,
        "w_v": w_v.view(HEADS, HEAD_WIDTH, WIDTH),  # (H, d_h, d): V_h
        "w_o": w_o,
        "bias": bias,
    }


def run_stack(blocks: nn.ModuleList, norms: nn.ModuleList, x: torch.Tensor, causal: torch.Tensor) -> list[dict]:
    """Forward through the pre-norm stack; return each layer's readout with its input h and output."""
    layers = []
    for norm, block in zip(norms, blocks, strict=True):
        h = norm(x)
        out, _ = block(h, h, h, attn_mask=~causal)  # nn.MultiheadAttention: True = blocked
        layers.append({**read_layer(block, h[0], causal), "input": h[0], "output": out[0]})
        x = x + out
    return layers


def diagnostics(layer: dict, causal: torch.Tensor, previous_walk: torch.Tensor | None) -> dict[str, float]:
    args = (layer["attn"], layer["w_v"], layer["w_o"])
    walk_output = F.connection_matvec(*args, layer["input"]) + layer["bias"]
    P = F.walk_matrix(layer["attn"])
    return {
        "recon_err": (torch.linalg.norm(layer["output"] - walk_output) / torch.linalg.norm(layer["output"])).item(),
        "entropy_norm": F.attention_entropy(layer["attn"], normalized=True, mask=causal).item(),
        "max_logit": F.max_attention_logit(layer["logits"]).item(),
        "reversibility": F.reversibility_gap(P).item(),
        "walk_gap": F.walk_spectral_gap(P).item(),
        "head_iso": F.head_isometry_gap(layer["w_v"], layer["w_o"]).item(),
        "ov_iso": F.ov_isometry_gap(layer["w_v"], layer["w_o"]).item(),
        "edge_iso": F.edge_isometry_gap(*args, num_samples=4).item(),
        "symmetry": F.transport_symmetry_gap(layer["w_v"], layer["w_o"]).item(),
        "scale": F.transport_scale(layer["w_v"], layer["w_o"]).item(),
        "radius": F.connection_spectral_radius(*args).item(),
        "op_norm": F.connection_operator_norm(*args).item(),
        "lap_gap": F.connection_laplacian_gap(*args).item(),
        "depth_drift": float("nan") if previous_walk is None else F.depth_drift(P, previous_walk).item(),
    }


@torch.no_grad()
def main() -> None:
    blocks = nn.ModuleList(nn.MultiheadAttention(WIDTH, HEADS, batch_first=True) for _ in range(LAYERS))
    norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(LAYERS))
    for block in blocks:  # sharper attention than the default init, and nonzero biases, as after some training
        block.in_proj_weight.mul_(3.0)
        nn.init.normal_(block.in_proj_bias, std=0.1)
        nn.init.normal_(block.out_proj.bias, std=0.1)
    causal = torch.ones(N_TOKENS, N_TOKENS, dtype=torch.bool).tril()  # True = allowed key
    x = torch.randn(1, N_TOKENS, WIDTH)

    before = run_stack(blocks, norms, x, causal)
    print(f"{LAYERS} pre-norm causal attention layers, n={N_TOKENS} tokens, d={WIDTH}, H={HEADS} heads\n")
    walks = [F.walk_matrix(layer["attn"]) for layer in before]
    rows = [diagnostics(layer, causal, walks[i - 1] if i else None) for i, layer in enumerate(before)]
    print("layer " + " ".join(f"{name:>13}" for name in rows[0]))
    for index, row in enumerate(rows):
        print(f"L{index:02d}   " + " ".join(f"{value:>13.4g}" for value in row.values()))

    for parameter in blocks.parameters():  # about one optimizer step's worth of change
        parameter.add_(1e-2 * torch.randn_like(parameter))
    after = run_stack(blocks, norms, x, causal)
    print("\nafter nudging every attention weight by 1e-2, on the same input:")
    for index, (old, new) in enumerate(zip(before, after, strict=True)):
        walk_drift = F.time_drift(F.walk_matrix(new["attn"]), walks[index]).item()
        ov_drift = F.transport_drift(F.ov_transport(new["w_v"], new["w_o"]), F.ov_transport(old["w_v"], old["w_o"]))
        print(f"L{index:02d}   time_drift={walk_drift:.4g}   transport_drift={ov_drift.item():.4g}")


if __name__ == "__main__":
    main()
