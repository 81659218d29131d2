"""A transformer sharded over the ranks as it loads (FSDP2, ``wanexp-sample --shard``): each rank builds the model
without weights, shards every block and the root over the ranks (``fully_shard``: each parameter's dim-0 chunks),
and reads from the folder's safetensors files only the rows of its own chunks, straight into its device. No rank
holds the whole model on its GPU or in host memory beyond the file pages it reads, and nothing is communicated
while it loads (the weights are never broadcast from rank 0). In the forward each block's parameters are gathered
for its call and freed after it (``reshard_after_forward``), so a GPU holds 1/N of the weights plus one block.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from wanexp.errors import ConfigError


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file of a diffusers-format component folder that holds it."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "diffusion_pytorch_model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{folder}: no diffusion_pytorch_model.safetensors(.index.json) to load sharded; "
                          "--shard reads diffusers-format safetensors folders")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def diffusers_folder(spec, expert: str):
    """A diffusers-format expert folder's transformer built without weights (parameters on the meta device, the
    buffers such as rotary tables real) and where each parameter is: name -> (safetensors file, key)."""
    from accelerate import init_empty_weights

    folder = Path(spec.path) / spec.expert_folders[expert]
    cls = spec.transformer_type()
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(cls.load_config(folder))
    return model, {k: (f, k) for k, f in safetensors_index(folder).items()}, folder


def load_sharded(spec, expert: str, device, mesh, source=diffusers_folder):
    """``spec``'s transformer ``expert`` sharded over ``mesh`` (a 1-D DeviceMesh of every rank), its weights read
    rank by rank into ``device``; prepared as ``spec.load_transformer`` prepares it (the family's forward).
    ``source(spec, expert)``: the model built without weights, where each parameter is (name -> (file, key)) and the
    folder (for messages); a family whose files name its parameters otherwise passes its own."""
    from safetensors import safe_open
    from torch.distributed.fsdp import fully_shard

    model, files, folder = source(spec, expert)
    model.requires_grad_(False)
    cast(model, spec.dtype, getattr(type(model), "_keep_in_fp32_modules", None) or [])
    spec.set_attention_backend(model)
    model = spec.prepare_transformer(model)
    buffers = {n: b.to(device) for n, b in model.named_buffers()}
    for block in spec.blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    missing = [n for n, _ in model.named_parameters() if n not in files]
    if missing:
        raise ConfigError(f"{folder}: {len(missing)} weight(s) of the transformer are not in its safetensors files "
                          f"(e.g. {missing[0]}); the folder does not match its config.json")
    rank, world = mesh.get_local_rank(), mesh.size()
    handles: dict[Path, object] = {}
    try:
        for name, param in model.named_parameters():
            path, key = files[name]
            f = handles.get(path)
            if f is None:
                f = handles[path] = safe_open(str(path), "pt").__enter__()
            local = param.to_local()
            rows = -(-param.shape[0] // world)  # torch.chunk's chunk size: FSDP2's dim-0 split
            start = rank * rows
            if local.numel():
                local.copy_(f.get_slice(key)[start:start + local.shape[0]].to(local.dtype))
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)
    return model.eval()


def cast(model, dtype: torch.dtype, keep_fp32: list[str]) -> None:
    """The parameters (still on the meta device) in ``dtype``, those of the modules the class keeps in fp32 in fp32,
    as diffusers' ``from_pretrained(dtype=...)`` leaves them."""
    for module_name, module in model.named_modules():
        for n, p in list(module._parameters.items()):
            if p is None:
                continue
            name = f"{module_name}.{n}" if module_name else n
            want = torch.float32 if any(k in name.split(".") for k in keep_fp32) else dtype
            module._parameters[n] = torch.nn.Parameter(p.to(want), requires_grad=False)
