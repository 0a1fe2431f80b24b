"""Every connection-walk diagnostic of a small causal transformer, per layer, from one captured forward pass.

A 4-layer pre-norm stack of torch.nn.MultiheadAttention blocks with random weights (sharpened, with biases, as
after some training) reads random embeddings. connmon.analyze captures each layer, checks that the connection
walk rebuilds its output exactly (the paper's identity: attention output = M(X) + c) and prints the diagnostics
of docs/diagnostics.md. The script then nudges every attention weight as one optimizer step would, captures the same
input again, and prints how far each layer's walk and transport moved (time and transport drift).

    python examples/diagnose_attention.py

Runs in a few seconds on a CPU; no downloads.
"""

from __future__ import annotations

import torch
from torch import nn

import connmon
import connmon.functional as F

N_TOKENS, WIDTH, HEADS, LAYERS = 32, 64, 4, 4
COLUMNS = {
    "reconstruction_error": "recon_err",
    "attention_entropy_normalized": "entropy_norm",
    "max_attention_logit": "max_logit",
    "walk_spectral_gap": "walk_gap",
    "head_isometry_gap": "head_iso",
    "ov_isometry_gap": "ov_iso",
    "edge_isometry_gap": "edge_iso",
    "transport_symmetry_gap": "symmetry",
    "transport_scale": "scale",
    "connection_spectral_radius": "radius",
    "connection_operator_norm": "op_norm",
    "connection_laplacian_gap": "lap_gap",
    "depth_drift": "depth_drift",
}


class PreNormStack(nn.Module):
    """x <- x + attention(norm(x)), causal, LAYERS times."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(LAYERS))
        self.attns = nn.ModuleList(nn.MultiheadAttention(WIDTH, HEADS, batch_first=True) for _ in range(LAYERS))
        self.register_buffer("blocked", torch.ones(N_TOKENS, N_TOKENS, dtype=torch.bool).triu(1))  # True = blocked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, n, d) -> (B, n, d)``."""
        for norm, attn in zip(self.norms, self.attns, strict=True):
            h = norm(x)
            x = x + attn(h, h, h, attn_mask=self.blocked, need_weights=False)[0]
        return x


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    model = PreNormStack()
    for attn in model.attns:  # sharper attention than the default init, and nonzero biases
        attn.in_proj_weight[: 2 * WIDTH] *= 3.0
        nn.init.normal_(attn.in_proj_bias, std=0.1)
        nn.init.normal_(attn.out_proj.bias, std=0.1)
    x = torch.randn(2, N_TOKENS, WIDTH)

    report = connmon.analyze(model, x, num_sequences=1)
    print(f"{LAYERS} pre-norm causal attention layers, n={N_TOKENS} tokens, d={WIDTH}, H={HEADS} heads\n")
    print("layer " + " ".join(f"{short:>12}" for short in COLUMNS.values()))
    for layer in report.layers:
        print(f"L{layer['index']:02d}   " + " ".join(f"{layer.get(key, float('nan')):>12.4g}" for key in COLUMNS))

    before = connmon.capture(model, x, num_sequences=1)
    for parameter in model.attns.parameters():  # about one optimizer step's worth of change
        parameter.add_(1e-2 * torch.randn_like(parameter))
    after = connmon.capture(model, x, num_sequences=1)
    print("\nafter nudging every attention weight by 1e-2, on the same input:")
    for old, new in zip(before, after, strict=True):
        walk_drift = F.time_drift(F.walk_matrix(new.attn), F.walk_matrix(old.attn)).item()
        ov_drift = F.transport_drift(F.ov_transport(new.w_v, new.w_o), F.ov_transport(old.w_v, old.w_o)).item()
        print(f"L{old.index:02d}   time_drift={walk_drift:.4g}   transport_drift={ov_drift:.4g}")


if __name__ == "__main__":
    main()
