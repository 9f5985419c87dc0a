"""Fine-tuning on many processes, as ``torchrun`` starts them (docs/training.md, "Many processes"): the
process group, each rank's share of a step's global batch, and the gradients and losses summed over
ranks. One process is the same code with a world of one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Ranks", "keyed_generator"]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's processes."""

    rank: int = 0  # this process (0 writes every file)
    world: int = 1  # how many processes train together
    local_rank: int = 0  # this process on its node (its GPU)

    @classmethod
    def start(cls, device: str | None) -> Ranks:
        """The process group torchrun's environment describes (gloo on CPUs, nccl on CUDA), or one process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        ranks = cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if (device or "").startswith("cuda") else "gloo")
        return ranks

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: str | None) -> str | None:
        """This process's device: on CUDA, its own GPU (``cuda:LOCAL_RANK``)."""
        if self.world > 1 and device == "cuda":
            return f"cuda:{self.local_rank}"
        return device

    def share(self, batch: Sequence[int]) -> list[int]:
        """This rank's conversations of a global batch of ``world`` x accumulate (rank r the r-th slice)."""
        per = len(batch) // self.world
        return list(batch[self.rank * per:(self.rank + 1) * per])

    def shard(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Full fine-tuning sharded (FSDP2): each Nemotron-H block, TTS backbone layer and Conformer layer
        that trains is its own unit; the frozen parts, the codec among them, stay whole on every rank.
        Their gradients are summed, as :meth:`sum_gradients` sums the others'. Returns the units."""
        from torch.distributed.fsdp import fully_shard

        layers = [*model.stt_model.llm.layers, *model.tts_model.tts_model.backbone.layers,
                  *model.stt_model.perception.encoder.layers]
        units = [m for m in layers if any(p.requires_grad for p in m.parameters())]
        for unit in units:
            fully_shard(unit)
        return units

    def whole_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A sharded model's whole state dict, gathered on rank 0 (in CPU memory; the others get none).
        Every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Every trainable gradient summed over the ranks, in one flat all-reduce (only those travel:
        a frozen base, packed or not, has none)."""
        if self.world == 1:
            return
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for p in params:
            if isinstance(p, DTensor) and p.grad is not None:
                # FSDP reduced these already, as the mean over ranks (gloo has no pre-scaled sum): the sum
                # again, as each loss is weighted by 1 / global batch.
                p.grad.mul_(self.world)
        params = [p for p in params if not isinstance(p, DTensor)]
        if not params:
            return
        # A conversation without agent audio leaves the TTS's gradients at None: a gradient any rank has
        # travels (zeros where a rank has none); one that no rank has stays None, as on one process.
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        dist.all_reduce(present)
        chosen = [p for p, count in zip(params, present.tolist()) if count > 0]
        if not chosen:
            return
        for p in chosen:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in chosen if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_losses(self, totals: dict[str, float]) -> dict[str, float]:
        """The global batch's losses: each rank's sums, added up (every rank gets them)."""
        if self.world == 1:
            return totals
        import torch.distributed as dist

        gathered: list[dict[str, float]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, totals)
        out: dict[str, float] = {}
        for part in gathered:
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def keyed_generator(seed: int, step: int, conversation: int, device: torch.device) -> torch.Generator:
    """The generator of one conversation's random draws at one step, keyed by (seed, step, conversation):
    the draws do not depend on which process runs the conversation, or after which others."""
    key = ((seed * 1_000_003 + step) * 1_000_003 + conversation) % (1 << 63)
    return torch.Generator(device=device).manual_seed(key)
