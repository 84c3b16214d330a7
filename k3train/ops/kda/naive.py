"""Kimi Delta Attention, token by token: the slow reference every fast path is tested against.

Per head, with state S [K, V] and alpha_t = exp(g_t) (one decay per key channel):
    S <- Diag(alpha_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T        (delta rule: replace what k_t currently reads)
    o_t = S^T (scale * q_t)                      (read after the update)
q and k are used as given (the caller L2-normalises them); g is the log-decay (<= 0).
"""

from __future__ import annotations

import torch

from .utils import check_inputs, compute_dtype


def _recurrence(q, k, v, g, beta, S):
    """q, k, g [b, L, H, K]; v [b, L, H, V]; beta [b, L, H]; S [b, H, K, V]. Returns (o [b, L, H, V], S)."""
    outs = []
    for t in range(k.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        read = (kt.unsqueeze(-1) * S).sum(-2)  # S^T k_t
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - read)
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-1) * S).sum(-2))  # S^T q_t
    return torch.stack(outs, dim=1), S


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Reference KDA. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B or N, H, K, V].

    With cu_seqlens (B must be 1) each of the N documents starts from its own initial state (zero if None).
    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] in fp32 (fp64 for fp64 inputs) or None).
    """
    s = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    scale = s.K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q * scale
    S0 = initial_state.to(dt) if initial_state is not None else q.new_zeros(s.N, s.H, s.K, s.V)
    if s.cu is None:
        o, S = _recurrence(q, k, v, g, beta, S0)
    else:
        outs, finals = [], []
        offsets = s.cu.tolist()  # the slow reference reads its documents on the host
        for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            o_n, S_n = _recurrence(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S0[n : n + 1])
            outs.append(o_n)
            finals.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(v.dtype), (S if output_final_state else None)
