"""One expert's weights on the device at a time (``wanexp-sample --offload-experts``): a two-expert model (A14B)
generates with the expert whose steps run on the GPU and the other in host memory.

The weights do not change while a model samples, so each transformer's parameter storage is copied to (pinned) host
memory once, as it loads; leaving the device then only frees the device storage (``resize_(0)``), and coming back
re-grows the same storage and copies the host bytes into it. The tensors, their views and every reference
to them (FSDP2's sharded parameters and its unsharded root parameters included) stay valid: only their memory comes
and goes. A transformer is brought in by a forward pre-hook that runs before any other (FSDP2's gathering included),
which first sends the expert on the device out. A sample moves each expert in once (the high-noise steps come first,
then the low-noise ones): about 14 GB through PCIe for an A14B expert on one GPU, half of it per rank when sharded
over two.
"""
from __future__ import annotations

import torch
from torch import nn


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's tensor on this process: a sharded (DTensor) one's local shard, else itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def _storages(module: nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages of a module's parameters (a sharded one's local shards), on whatever device."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in module.parameters():
        storage = _local(p).untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _own_storage(module: nn.Module) -> None:
    """Parameters whose memory cannot be resized (a file's pages: weights loaded on the CPU) copied into their own."""
    for p in module.parameters():
        if not _local(p).untyped_storage().resizable():
            p.data = p.data.clone()


class ExpertOffload:
    """Keeps at most one of ``modules`` (name -> transformer, all on ``device``) resident; the first one called stays,
    the others leave at :meth:`attach`. ``moves`` counts each transformer's arrivals (for the tests and metrics)."""

    def __init__(self, modules: dict[str, nn.Module], device):
        self.modules = dict(modules)
        self.device = torch.device(device)
        self.host: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        self.resident: str | None = None
        self.moves = {n: 0 for n in self.modules}

    def attach(self, first: str) -> "ExpertOffload":
        """Hook every transformer; ``first`` stays on the device, the others go to host memory now. Every
        transformer's host copy is made here, while loading, so that a switch during a sample only frees one device
        storage and fills the other (a first copy out at the switch, with its pinned allocation, took seconds)."""
        for name, module in self.modules.items():
            _own_storage(module)
            self._copy_out(name)
        for name, module in self.modules.items():
            module.register_forward_pre_hook(self._hook(name), prepend=True)
        self.resident = first
        for name in self.modules:
            if name != first:
                self._leave(name)
        return self

    def _hook(self, name: str):
        def bring(module, args):
            self.use(name)
        return bring

    def use(self, name: str) -> None:
        """Make ``name`` the transformer on the device (the one there goes to host memory first)."""
        if self.resident == name:
            return
        if self.resident is not None:
            self._leave(self.resident)
        self._arrive(name)
        self.resident = name

    def _copy_out(self, name: str) -> None:
        """The transformer's bytes in pinned host memory (once: frozen weights never change)."""
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        copies = []
        for storage in _storages(self.modules[name]):
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(data)
            copies.append((storage, host))
        self.host[name] = copies

    def _leave(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies out, and any work still reading them
        for storage, _ in self.host[name]:
            storage.resize_(0)

    def _arrive(self, name: str) -> None:
        copies = self.host.get(name)
        if not copies or copies[0][0].nbytes():  # never left, or here already
            return
        for storage, host in copies:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=True)
        self.moves[name] += 1

    def held_bytes(self) -> int:
        """Bytes of the transformers' parameter storage on the device now."""
        return sum(s.nbytes() for m in self.modules.values() for s in _storages(m))
