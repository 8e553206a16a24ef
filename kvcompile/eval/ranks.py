"""Data-parallel lm-eval: one process per device, started by torchrun, talking through ``torch.distributed``.

lm-eval splits each task's documents by ``lm.rank`` and ``lm.world_size``, and pads and collects them through the
model's ``all_gather``, ``gather_object`` and ``barrier``; this mixin answers those calls over one process group
(gloo on CPU, nccl on CUDA) joined from the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
Without torchrun it is one process and every call is local."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launched() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun set them; (0, 1, 0) in a plain process."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


class DataParallel:
    """The collective calls lm-eval makes on its model (its ``_rank`` and ``_world_size`` are set here)."""

    def join_ranks(self, device: str | None) -> str | None:
        """Join torchrun's process group (once per process) and return the device this rank runs on: its own GPU
        when there are GPUs, else ``device``."""
        rank, world, local = launched()
        self._rank, self._world_size = rank, world
        if world == 1:
            return device
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        return f"cuda:{local}" if cuda else "cpu"

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order (lm-eval gathers per-rank request counts)."""
        if self._world_size == 1:
            return tensor[None]
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(out, tensor)
        return torch.stack(out)

    def gather_object(self, obj, dst: int = 0) -> list | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; None on the others."""
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()
