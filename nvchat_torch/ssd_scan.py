"""Mamba-2's SSM over a whole sequence in chunks (the SSD form), the prompt prefill's scan: equal to
the per-token recurrence that :class:`~nvchat_torch.nemotron_h.NemotronHMamba2Mixer` steps with."""

from __future__ import annotations

import torch

__all__ = ["ssd_scan", "SSD_CHUNK"]

SSD_CHUNK = 256  # sequence chunk of the SSD scan (as the reference's ssm_attn)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over a sequence in chunks (Mamba-2's SSD form), equal to the per-token recurrence.

    x [b, L, H, P], dt [b, L, H] float32, A [H] float32, B and C [b, L, G, N] (head h reads group
    h // (H/G)), state [b, H, P, N] float32 or None (zeros). Returns y [b, L, H, P] float32
    (without the D skip) and the final state.
    """
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G
    ys = []
    for start in range(0, L, SSD_CHUNK):
        xc, dtc = x[:, start:start + SSD_CHUNK], dt[:, start:start + SSD_CHUNK]
        Bc, Cc = B[:, start:start + SSD_CHUNK], C[:, start:start + SSD_CHUNK]
        s = xc.shape[1]
        a = (dtc * A).transpose(1, 2)  # [b, H, s] log-decay per step
        dtx = (dtc.unsqueeze(-1) * xc).transpose(1, 2)  # [b, H, s, P]
        # seg[t, u] = sum of a over (u, t]: a cumulative sum of a strictly lower-triangular copy,
        # which avoids the cancellation of cumsum[t] - cumsum[u].
        seg = a.unsqueeze(-1).expand(b, H, s, s).tril(-1).cumsum(-2)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        decay = seg.exp().masked_fill(~causal, 0.0)
        CB = torch.einsum("btgn,bugn->bgtu", Cc, Bc).float()  # [b, G, s, s]
        y = (CB.unsqueeze(2) * decay.view(b, G, R, s, s)).view(b, H, s, s) @ dtx
        # State at the chunk end: every input decayed from its step to the last one.
        Bg = Bc.transpose(1, 2).unsqueeze(2).float()  # [b, G, 1, s, N]
        weighted = (dtx * decay[:, :, -1, :].unsqueeze(-1)).view(b, G, R, s, P)
        new_state = (weighted.transpose(-1, -2) @ Bg).view(b, H, P, N)
        if state is not None:
            cum = a.cumsum(-1)  # [b, H, s]
            Cg = Cc.transpose(1, 2).unsqueeze(2).float()  # [b, G, 1, s, N]
            y_prev = (Cg @ state.view(b, G, R, P, N).transpose(-1, -2)).view(b, H, s, P)
            y = y + cum.exp().unsqueeze(-1) * y_prev
            new_state = new_state + cum[..., -1].exp()[..., None, None] * state
        state = new_state
        ys.append(y.transpose(1, 2))
    if state is None:
        raise ValueError("ssd_scan: an empty sequence (L = 0) has no final state")
    return torch.cat(ys, 1) if len(ys) > 1 else ys[0], state
