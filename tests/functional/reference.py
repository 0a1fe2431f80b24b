"""Dense float64 references written straight from docs/diagnostics.md, one loop per definition.

Nothing here shares code with connmon.functional: numpy and scipy do the linear algebra, and every quantity is
built the slow, obvious way (explicit T_h, T_ij and kron operators, vector iteration for pi).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Layer:
    """One attention layer on one sequence, in torch (for connmon) and float64 numpy (for the references)."""

    attn: torch.Tensor  # (H, n, n)
    logits: torch.Tensor  # (H, n, n), -inf where blocked
    allowed: torch.Tensor  # (H, n, n) bool
    w_v: torch.Tensor  # (H, d_h, d), GQA expanded
    w_o: torch.Tensor  # (H, d, d_h)

    @property
    def np(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (self.attn.double().numpy(), self.w_v.double().numpy(), self.w_o.double().numpy())


def make_layer(
    heads: int = 4,
    n: int = 6,
    d_h: int = 2,
    d: int = 8,
    kv_heads: int | None = None,
    mask: str = "none",
    sharpness: float = 2.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Layer:
    """A random layer. mask: "none", "causal", "padded" (keys padded, causal, so query 0 sees no key)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    logits = sharpness * torch.randn(heads, n, n, generator=gen, dtype=torch.float64)
    allowed = torch.ones(heads, n, n, dtype=torch.bool)
    if mask not in ("none", "causal", "padded"):
        raise ValueError(mask)
    if mask in ("causal", "padded"):
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    if mask == "padded":
        allowed[..., : max(1, n // 3)] = False  # left padding: the first keys are padding
    logits = logits.masked_fill(~allowed, float("-inf"))
    attn = torch.nan_to_num(logits.softmax(-1), nan=0.0)  # a row with no allowed key is all zeros
    w_v_kv = torch.randn(kv_heads, d_h, d, generator=gen, dtype=torch.float64) / d**0.5
    w_v = w_v_kv.repeat_interleave(heads // kv_heads, dim=0)  # query head h reads kv head h // (H / H_kv)
    w_o = torch.randn(heads, d, d_h, generator=gen, dtype=torch.float64) / (heads * d_h) ** 0.5
    return Layer(attn.to(dtype), logits.to(dtype), allowed, w_v.to(dtype), w_o.to(dtype))


# --- walk ---------------------------------------------------------------------------------------------------------


def walk(attn: np.ndarray) -> np.ndarray:
    return sum(attn[h] for h in range(attn.shape[0])) / attn.shape[0]


def stochasticity_gap(P: np.ndarray) -> float:
    gaps = [abs(row.sum() - 1) for row in P if np.any(row != 0)]
    return max(gaps, default=0.0)


def attention_entropy(attn: np.ndarray, allowed: np.ndarray, normalized: bool) -> float:
    values = []
    for h in range(attn.shape[0]):
        for i in range(attn.shape[1]):
            keys = int(allowed[h, i].sum())
            if keys == 0 or (normalized and keys == 1):
                continue
            entropy = -sum(p * np.log(p) for p in attn[h, i] if p > 0)
            values.append(entropy / np.log(keys) if normalized else entropy)
    return float(np.mean(values)) if values else float("nan")


def stationary_distribution(P: np.ndarray, tol: float = 1e-14, max_steps: int = 2_000_000) -> np.ndarray:
    """u^T ((I + P)/2)^t by plain vector iteration until it stops moving."""
    n = P.shape[0]
    valid = np.any(P != 0, axis=1)
    chain = P + np.diag((~valid).astype(float))
    lazy = (np.eye(n) + chain) / 2
    pi = valid / valid.sum() if valid.any() else np.full(n, 1 / n)
    for _ in range(max_steps):
        nxt = pi @ lazy
        if np.abs(nxt - pi).max() < tol:
            return nxt
        pi = nxt
    raise RuntimeError("reference power iteration did not converge")


def reversibility_gap(P: np.ndarray) -> float:
    Pi = np.diag(stationary_distribution(P))
    a, b = Pi @ P, P.T @ Pi
    den = np.linalg.norm(a) + np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den else 0.0


def walk_spectral_gap(P: np.ndarray) -> float:
    moduli = np.sort(np.abs(np.linalg.eigvals(P)))[::-1]
    return float(1 - moduli[1]) if len(moduli) > 1 else 1.0


def max_attention_logit(logits: np.ndarray, allowed: np.ndarray) -> float:
    return max(logits[h, i, j] for h, i, j in zip(*np.nonzero(allowed), strict=True))


# --- transport ----------------------------------------------------------------------------------------------------


def head_maps(w_v: np.ndarray, w_o: np.ndarray) -> list[np.ndarray]:
    return [w_o[h] @ w_v[h] for h in range(w_v.shape[0])]


def nearest_isometry_gap(T: np.ndarray) -> float:
    """||T - s* Q||_F / ||T||_F, Q the polar factor of T (d x r, r = its domain) and s* the mean singular value."""
    u, s, vt = np.linalg.svd(T, full_matrices=False)
    if not s.any():
        return 0.0
    return float(np.linalg.norm(T - s.mean() * (u @ vt)) / np.linalg.norm(T))


def head_gaps(w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """Each T_h restricted to its own d_h-dim domain, the row space of V_h."""
    gaps = []
    for h, T in enumerate(head_maps(w_v, w_o)):
        domain = np.linalg.svd(w_v[h], full_matrices=False)[2].T  # (d, d_h) orthonormal basis of row(V_h)
        gaps.append(nearest_isometry_gap(T @ domain))
    return np.array(gaps)


def head_singular_values(w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    d_h = w_v.shape[1]
    return np.stack([np.linalg.svd(T, compute_uv=False)[:d_h] for T in head_maps(w_v, w_o)])


def ov_map(w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    return sum(head_maps(w_v, w_o))


def edge_isometry_gap(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> float:
    heads, n, _ = attn.shape
    maps = head_maps(w_v, w_o)
    W = attn.sum(axis=0)
    queries = int((W != 0).any(axis=1).sum())  # edges drawn with probability P_ij / n: n counts rows with a key
    total = 0.0
    for i in range(n):
        for j in range(n):
            if W[i, j] == 0:
                continue
            T_ij = sum(attn[h, i, j] / W[i, j] * maps[h] for h in range(heads))
            total += W[i, j] / heads / queries * nearest_isometry_gap(T_ij)
    return total


def transport_scale(w_v: np.ndarray, w_o: np.ndarray) -> float:
    return float(np.linalg.svd(ov_map(w_v, w_o), compute_uv=False).mean())


# --- operator -----------------------------------------------------------------------------------------------------


def connection_operator(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    a, v, o = (torch.as_tensor(t, dtype=torch.float64) for t in (attn, w_v, w_o))
    return sum(torch.kron(a[h], o[h] @ v[h]) for h in range(a.shape[0])).numpy()


def quotient_basis(attn: np.ndarray, d: int) -> np.ndarray:
    """An orthonormal basis of range(Q), Q = (D_V - 1_V 1_V^T / m) kron I_d over the m valid tokens (attended keys)."""
    valid = (attn != 0).any(axis=(0, 1)).astype(float)
    projector = np.diag(valid) - np.outer(valid, valid) / valid.sum()
    values, vectors = np.linalg.eigh(projector)
    tokens = vectors[:, values > 0.5]  # eigenvalue 1: mean-zero fields on the valid tokens
    return np.kron(tokens, np.eye(d))


def walk_operator(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """Q M Q on range(Q), in an orthonormal basis of range(Q) (docs/diagnostics.md: the walk part)."""
    basis = quotient_basis(attn, w_v.shape[-1])
    return basis.T @ connection_operator(attn, w_v, w_o) @ basis


def spectrum(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, deflate: bool = False) -> np.ndarray:
    """All eigenvalues of M / s (deflate: of its walk part), descending modulus."""
    operator = walk_operator(attn, w_v, w_o) if deflate else connection_operator(attn, w_v, w_o)
    values = np.linalg.eigvals(operator) / transport_scale(w_v, w_o)
    return values[np.argsort(-np.abs(values), kind="stable")]


def ov_spectrum(w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """eig(T_bar / s): the constant-field part of the spectrum."""
    return np.linalg.eigvals(ov_map(w_v, w_o)) / transport_scale(w_v, w_o)


def causal_spectrum(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, deflate: bool = False) -> np.ndarray:
    """Block lower-triangular M: the union over tokens of eig(sum_h A^h_ii T_h), / s; descending modulus.

    deflate: the first valid token (its block is T_bar) and the tokens nobody attends are left out.
    """
    maps = head_maps(w_v, w_o)
    tokens = range(attn.shape[1])
    if deflate:
        valid = np.flatnonzero((attn != 0).any(axis=(0, 1)))
        tokens = valid[1:]
    blocks = [sum(attn[h, i, i] * maps[h] for h in range(len(maps))) for i in tokens]
    values = np.concatenate([np.linalg.eigvals(block) for block in blocks]) / transport_scale(w_v, w_o)
    return values[np.argsort(-np.abs(values), kind="stable")]


def operator_norm(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, deflate: bool = False) -> float:
    operator = walk_operator(attn, w_v, w_o) if deflate else connection_operator(attn, w_v, w_o)
    return float(np.linalg.norm(operator, 2) / transport_scale(w_v, w_o))


def relative_change(current: np.ndarray, previous: np.ndarray) -> float:
    return float(np.linalg.norm(current - previous) / np.linalg.norm(current))


# --- connection Laplacian form ------------------------------------------------------------------------------------


def _blocks(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """The d x d blocks B_ij of M / s, sliced out of the dense operator: (n, n, d, d)."""
    n, d = attn.shape[-1], w_v.shape[-1]
    M = connection_operator(attn, w_v, w_o) / transport_scale(w_v, w_o)
    return M.reshape(n, d, n, d).transpose(0, 2, 1, 3)


def edge_compatibility_gap(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> float:
    """sum P_ij P_ji ||T_ij - T_ji^T||^2 / (2 sum P_ij P_ji (||T_ij||^2 + ||T_ji||^2)) over i != j, square root."""
    heads, n, _ = attn.shape
    maps, W = head_maps(w_v, w_o), attn.sum(axis=0)
    P = W / heads

    def edge(i: int, j: int) -> np.ndarray:
        return sum(attn[h, i, j] / W[i, j] * maps[h] for h in range(heads)) if W[i, j] else 0 * maps[0]

    num = den = 0.0
    for i in range(n):
        for j in range(n):
            if i != j and P[i, j] * P[j, i] > 0:
                num += P[i, j] * P[j, i] * np.linalg.norm(edge(i, j) - edge(j, i).T) ** 2
                den += 2 * P[i, j] * P[j, i] * (np.linalg.norm(edge(i, j)) ** 2 + np.linalg.norm(edge(j, i)) ** 2)
    return float(np.sqrt(num / den)) if den else float("nan")


def laplacian_form(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """The nearest N with N_ij = P_ij R_ij, R_ij = polar(P_ij B_ij + P_ji B_ji^T), R_ji = R_ij^T: (n d, n d)."""
    n, d = attn.shape[-1], w_v.shape[-1]
    B, P = _blocks(attn, w_v, w_o), walk(attn)
    N = np.zeros((n, n, d, d))
    for i in range(n):
        for j in range(i, n):
            u, _, vt = np.linalg.svd(P[i, j] * B[i, j] + P[j, i] * B[j, i].T)
            N[i, j], N[j, i] = P[i, j] * (u @ vt), P[j, i] * (u @ vt).T
    return N.transpose(0, 2, 1, 3).reshape(n * d, n * d)


def connection_laplacian_distance(attn: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, fit_scale: bool = False) -> float:
    """||M/s - c N||_F / ||M/s||_F, N the nearest operator of the random-walk connection Laplacian's form.

    c = 1, or (fit_scale) the least-squares c = <M/s, N> / ||N||^2.
    """
    M = connection_operator(attn, w_v, w_o) / transport_scale(w_v, w_o)
    N = laplacian_form(attn, w_v, w_o)
    c = np.sum(M * N) / np.sum(N * N) if fit_scale else 1.0
    return float(np.linalg.norm(M - c * N) / np.linalg.norm(M))
