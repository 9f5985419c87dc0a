"""The mixture-of-Gaussians head of EAR-TTS (``tts_model.tts_model.mog_head``) and its sampling.

From the backbone's (conditional, unconditional) features it proposes the next latent: guidance
mixes the two rows, a component is drawn (top-p + Gumbel-max, or the most likely one in the
deterministic mode), and its low-rank mean and shared std give the proposal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from .config import MoGConfig
from .gemma import GatedMLP
from .layers import Linear, OffsetRMSNorm, adopt, promoted
from .quant import fuse_linears

__all__ = ["MoGLayer", "MoGHead", "FusedMoGHead", "sample_component", "draw", "Draws", "Generators"]

GUMBEL_EPS = 1e-8

# One generator for the whole batch, or one per row (None: a row that draws nothing this step).
Generators = Union[torch.Generator, Sequence[Optional[torch.Generator]], None]


def draw(sampler: Callable[..., torch.Tensor], shape: Sequence[int], generator: Generators,
         device: torch.device) -> torch.Tensor:
    """``sampler(shape)`` (``torch.rand``/``torch.randn``) from ``generator``; with one generator per row,
    each row draws its own ``shape[1:]`` from its own, exactly what that row alone would draw, so a
    session's samples never depend on the rows it shares a batch with (a None row draws nothing: 0)."""
    if generator is None or isinstance(generator, torch.Generator):
        return sampler(tuple(shape), generator=generator, device=device)
    row = (1, *shape[1:])
    return torch.cat([torch.zeros(row, device=device) if g is None else sampler(row, generator=g, device=device)
                      for g in generator])


@dataclass
class Draws:
    """A TTS step's random numbers, drawn before the step from the rows' generators: ``uniform [draws, B,
    components]`` (each MoG draw's component choice) and ``normal [draws, B, latent]`` (its noise; None
    without noise). Each generator gives them in the order the step consumes them (a draw's uniforms,
    then its normals), so they are the values the step would draw itself, and the step is a function of
    tensors only: what a compiled step needs (a graph takes no generator)."""

    uniform: torch.Tensor
    normal: torch.Tensor | None

    @classmethod
    def take(cls, generator: Generators, batch: int, draws: int, components: int, latent: int, noise: bool,
             device: torch.device) -> "Draws":
        """The draws of ``batch`` rows from one generator, or one per row (a None row draws nothing: 0), each
        by :func:`draw`: per generator, a draw's uniforms then its normals, draw after draw."""
        uniform, normal = [], []
        for _ in range(draws):
            uniform.append(draw(torch.rand, (batch, components), generator, device))
            if noise:
                normal.append(draw(torch.randn, (batch, latent), generator, device))
        return cls(torch.stack(uniform), torch.stack(normal) if noise else None)


class MoGLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = OffsetRMSNorm(hidden_size, eps, fp32=True)
        self.mlp = GatedMLP(hidden_size, intermediate_size)
        self.post_norm = OffsetRMSNorm(hidden_size, eps, fp32=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm.add_to(x, self.mlp(x, self.pre_norm))


def sample_component(logits: torch.Tensor, top_p: float, generator: Generators | torch.Tensor) -> torch.Tensor:
    """A draw over the last axis of ``logits`` among the components kept by top-p (the reference's
    rule: keep k iff the probability mass strictly above k is < ``top_p``).

    Gumbel-max in the form ``argmax(p_k / E_k)`` with ``E_k = -log(u_k)`` exponential (equal to
    ``argmax(log p_k + g_k)``, g Gumbel), done in the descending order of the probabilities, where
    top-p is a prefix: no scatter back, one gather of the winner's index. ``generator``: the generator(s)
    to draw the uniforms from, or the uniforms ``[B, components]`` drawn already (:class:`Draws`).
    """
    probs, order = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        mass_above = probs.cumsum(-1) - probs
        probs = torch.where(mass_above < top_p, probs, 0.0)
    uniform = generator if isinstance(generator, torch.Tensor) else draw(torch.rand, probs.shape, generator, probs.device)
    exponential = torch.rsub(torch.log(uniform + GUMBEL_EPS), GUMBEL_EPS)  # -log(u) (guarded)
    return order.gather(-1, (probs / exponential).argmax(-1, keepdim=True)).squeeze(-1)


class MoGHead(nn.Module):
    """Proposes the next latent from the (conditional, unconditional) features (``mog_head``).

    ``mlp_stack`` (3 residual MLPs + a norm) runs on both rows; guidance mixes the features
    (``c + g (c - u)``); a component k is drawn from ``proj_logits`` (or the most likely one);
    its mean is ``low_mat[k] @ (W_mus[k] @ x) * std + proj_else(x)``, ``std = exp(max(proj_logs(x), min))``.
    """

    def __init__(self, hidden_size: int, out_size: int, config: MoGConfig):
        super().__init__()
        self.out_size = out_size
        self.num_predictions, self.low_rank = config.num_predictions, config.low_rank
        self.min_log_std = config.min_log_std
        self.mlp_stack = nn.ModuleList(
            [MoGLayer(hidden_size, config.intermediate_size, config.eps) for _ in range(config.num_layers)]
            + [OffsetRMSNorm(hidden_size, config.eps, fp32=True)])
        self.proj_logits = Linear(hidden_size, config.num_predictions, bias=False)
        self.proj_mus = Linear(hidden_size, config.num_predictions * config.low_rank, bias=False)
        self.proj_logs = Linear(hidden_size, 1, bias=False)
        self.proj_else = Linear(hidden_size, out_size, bias=False)
        self.low_mat = nn.Parameter(torch.zeros(config.num_predictions, out_size, config.low_rank))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Component logits, log std and the rest of the mean."""
        return self.proj_logits(x), self.proj_logs(x), self.proj_else(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``mlp_stack`` on every row."""
        for layer in self.mlp_stack:
            x = layer(x)
        return x

    def distribution(self, features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The whole mixture at every row, as NeMo's ``MoGHead.forward`` gives it to the losses
        (ear_tts_model.py 616-639): component logits, low-rank means ``[..., K, r]``, the rest of the
        mean, and the log std clamped at ``min_log_std``."""
        logits, log_std, rest = self.heads(features)
        mus = self.proj_mus(features).unflatten(-1, (self.num_predictions, self.low_rank))
        return logits, mus, rest, log_std.clamp(min=self.min_log_std)

    def distance(self, mus: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``|L_k m_k - y|^2`` per component ``[B, S, K]`` for means ``m [B, S, K, r]`` and a target
        ``y [B, S, latent]``, in float32 (NeMo's ``MoGHead.dist``, ear_tts_model.py 641-675)."""
        low_mat = self.low_mat.float()
        gram = low_mat.transpose(-1, -2) @ low_mat  # [K, r, r]
        wx_sq = (mus * torch.einsum("btni,nij->btnj", mus, gram)).sum(-1)
        y_sq = y.pow(2).sum(-1, keepdim=True)
        xwy = (mus * torch.einsum("bti,nij->btnj", y, low_mat)).sum(-1)
        return (wx_sq + y_sq - 2 * xwy).abs()

    def forward(self, x: torch.Tensor, guidance_scale: float, top_p: float, generator: Generators | torch.Tensor,
                deterministic: bool | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [2B, H]`` (each session's conditional, then unconditional row) -> (mean ``[B, out]``, std ``[B, 1]``).
        ``generator``: see :func:`sample_component`. ``deterministic``: for all rows, or per row ``[B]``
        (bool; those rows draw nothing)."""
        x = self.features(x).unflatten(0, (-1, 2))
        x = torch.lerp(x[:, 1], x[:, 0], 1.0 + guidance_scale)  # cond + g (cond - uncond)
        logits, log_std, rest = self.heads(x)
        if deterministic is True:
            component = logits.argmax(-1)
        else:
            component = sample_component(logits, top_p, generator)
            if isinstance(deterministic, torch.Tensor):  # rows of both kinds (the batched engine)
                component = torch.where(deterministic, logits.argmax(-1), component)
        mus = self.proj_mus.weight.view(self.num_predictions, self.low_rank, -1).index_select(0, component)
        low = self.low_mat.index_select(0, component)
        mus, low = mus.to(promoted(x, mus)), low.to(promoted(x, low))  # stored-dtype rows: promoted, as MLX
        mean = torch.matmul(low, torch.matmul(mus, x[..., None]))  # [1, out, 1]
        std = log_std.clamp(min=self.min_log_std).exp()
        return torch.addcmul(rest, mean.squeeze(-1), std), std


class FusedMoGHead(MoGHead):
    """``prepare()``'s swap for :class:`MoGHead`: ``proj_logits``, ``proj_logs`` and ``proj_else`` as one
    matmul (``proj_heads``)."""

    def __init__(self, head: MoGHead):
        adopt(self, head)
        fuse_linears(self, ["proj_logits", "proj_logs", "proj_else"], "proj_heads")

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj_heads(x).split([self.num_predictions, 1, self.out_size], dim=-1)
