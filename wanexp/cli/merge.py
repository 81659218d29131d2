"""wanexp-merge: bake an adapter into a copy of a model folder, or combine LoRAs into one file.

    wanexp-merge bake --model /models/Wan2.2-TI2V-5B-Diffusers --lora run/lora/final/ti2v5b_lora_comfyui.safetensors \\
        --strength 0.8 --out /models/ti2v5b-merged
    wanexp-merge combine --lora a.safetensors --lora b.safetensors --weight 1.0 --weight 0.5 --out ab.safetensors

``bake`` writes ``OUT/<transformer folder>/`` with every adapted weight replaced by what ComfyUI's loader makes of it
(LoRA, DoRA, LoKr, LoHa; the stored dtype kept); the model's other entries (VAE, text encoder, the other expert,
``model_index.json`` ...) are symbolic links to the source's, so ``model.path=OUT`` trains, samples or teaches (KD)
like the source folder does. ``combine`` concatenates the LoRAs' ranks (exact; see ``wanexp.adapters.merge.concat_loras``).
Bad input is one line, exit code 2, and nothing is written; the output appears only once complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from wanexp.errors import ConfigError, UserError, refuse

FAMILY_HELP = ("the model group (conf/model) whose family names the adapter's modules and the experts' folders "
               "(default: ti2v5b; any Wan2.2 group names them the same)")


def _parse(argv):
    ap = argparse.ArgumentParser(prog="wanexp-merge", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bake", help="bake an adapter into a copy of a diffusers model folder")
    b.add_argument("--model", required=True, help="the diffusers model folder (what model.path names)")
    b.add_argument("--lora", required=True, help="a LoRA/DoRA/LoKr/LoHa file (wanexp's, ComfyUI-, kohya- or "
                                                "diffusers-named)")
    b.add_argument("--strength", type=float, default=1.0, help="the adapter's strength (1: as trained)")
    b.add_argument("--expert", default=None,
                   help="the expert the adapter belongs to (default: the file's wanexp_expert, else dense); each "
                        "expert's folder is the family's")
    b.add_argument("--model-group", default="ti2v5b", help=FAMILY_HELP)
    b.add_argument("--out", required=True, help="the new model folder (must not exist, or be empty)")
    c = sub.add_parser("combine", help="combine LoRAs of the same modules (any ranks) into one file")
    c.add_argument("--lora", action="append", required=True, help="a LoRA file (give two or more)")
    c.add_argument("--weight", action="append", type=float, default=None,
                   help="a weight per --lora, in order (default: 1 each)")
    c.add_argument("--out", required=True, help="the combined .safetensors file (must not exist)")
    c.add_argument("--model-group", default="ti2v5b", help=FAMILY_HELP)
    return ap.parse_args(argv)


def main(argv=None) -> Path:
    args = _parse(argv)
    try:
        return bake(args) if args.command == "bake" else combine(args)
    except UserError as e:
        refuse(str(e))


def entry() -> None:
    """The console command (wanexp-merge)."""
    main()


# ---- checks shared by both commands ------------------------------------------------------------------------------
def _free_output(out: Path, folder: bool) -> None:
    if out.is_symlink() or (out.exists() and not (folder and out.is_dir() and not any(out.iterdir()))):
        raise ConfigError(f"--out {out}: already exists{' and is not an empty folder' if folder else ''}; name a "
                          "new path")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: its folder {out.parent} does not exist; create it or name another path")


def _existing_file(path: str, flag: str = "--lora") -> Path:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{flag} {path}: file not found; name an existing .safetensors file")
    return p


# ---- bake ----------------------------------------------------------------------------------------------------------
def _shards(folder: Path) -> list[Path]:
    """The transformer's safetensors files (one file, or the shards its index names)."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"--model: {folder} holds no diffusion_pytorch_model*.safetensors; name a diffusers-format "
                      "model folder (python -m wanexp.cli.convert makes one from the original layout)")


def _expert(args, lora: Path) -> str:
    if args.expert:
        return args.expert
    from safetensors import safe_open

    with safe_open(os.fspath(lora), "pt") as f:
        return (f.metadata() or {}).get("wanexp_expert", "dense")


def _weight_shapes(shards: list[Path]) -> dict[str, tuple[list[int], Path]]:
    from safetensors import safe_open

    out = {}
    for shard in shards:
        with safe_open(os.fspath(shard), "pt") as f:
            for key in f.keys():
                out[key] = (list(f.get_slice(key).get_shape()), shard)
    return out


def bake(args) -> Path:
    """Check everything, then write the merged transformer into a temporary folder renamed to ``--out``."""
    from wanexp.adapters import read_adapter
    from wanexp.adapters.merge import comfy_diff
    from wanexp.models.family import spec_class

    model, out = Path(args.model), Path(args.out)
    if not (model / "model_index.json").is_file() and not (model / "transformer").is_dir():
        raise ConfigError(f"--model {model}: not a diffusers model folder (no model_index.json or transformer/); name "
                          "the folder model.path names")
    lora = _existing_file(args.lora)
    _free_output(out, folder=True)
    family = spec_class(args.model_group, "--model-group")
    expert, folders = _expert(args, lora), family.expert_folders
    if expert not in folders:
        raise ConfigError(f"--expert {expert}: model group {args.model_group} has the experts {', '.join(folders)}")
    folder = folders[expert]
    if not (model / folder).is_dir():
        where = ", ".join(f"{e}: {f}/" for e, f in folders.items())
        raise ConfigError(f"--model {model}: no {folder}/ for the adapter's expert; set --expert ({where})")
    shards = _shards(model / folder)
    adapter = read_adapter(lora, f"--lora {lora}", family.adapter_naming)
    shapes = _weight_shapes(shards)
    for module, params in adapter.modules.items():
        key = f"{module}.weight"
        if key not in shapes:
            raise ConfigError(f"--lora {lora}: adapts {module}, which {model / folder} lacks: an adapter of another "
                              "model (or set --expert)")
        try:
            fits = list(comfy_diff(params)[0].shape) == shapes[key][0]
        except RuntimeError:  # factors that do not multiply
            fits = False
        if not fits:
            raise ConfigError(f"--lora {lora}: {module} does not fit the weight {shapes[key][0]} of {model / folder}: "
                              "an adapter of another model; use one trained on this model")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_merged(model, folder, shards, adapter, args.strength, tmp)
        if out.is_dir():
            out.rmdir()  # the empty folder --out named
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wanexp: merged {lora.name} (strength {args.strength:g}, {len(adapter.modules)} modules) into "
          f"{out / folder}; the other entries link to {model.resolve()}", flush=True)
    return out


def _write_merged(model: Path, folder: str, shards: list[Path], adapter, strength: float, tmp: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from wanexp.adapters.merge import patched_weight

    tmp.mkdir()
    for entry in sorted(model.iterdir()):
        if entry.name != folder:  # VAE, text encoder, the other expert, model_index.json: linked, not copied
            os.symlink(entry.resolve(), tmp / entry.name)
    (tmp / folder).mkdir()
    for entry in sorted((model / folder).iterdir()):
        if entry not in shards:  # config.json, the shard index
            shutil.copy2(entry, tmp / folder / entry.name)
    for shard in shards:
        with safe_open(os.fspath(shard), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        for key, w in tensors.items():
            params = adapter.modules.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
            if params is not None:
                tensors[key] = patched_weight(w, params, strength).to(w.dtype).contiguous()
        save_file(tensors, tmp / folder / shard.name, metadata=meta)
        del tensors


# ---- combine -------------------------------------------------------------------------------------------------------
def combine(args) -> Path:
    from wanexp.adapters import read_adapter
    from wanexp.adapters.export import save_adapter_file
    from wanexp.adapters.merge import concat_loras
    from wanexp.models.family import spec_class

    if len(args.lora) < 2:
        raise ConfigError("combine: give two or more --lora files")
    weights = args.weight or [1.0] * len(args.lora)
    if len(weights) != len(args.lora):
        raise ConfigError(f"combine: {len(weights)} --weight for {len(args.lora)} --lora; give one per file (or none)")
    out = Path(args.out)
    files = [_existing_file(p) for p in args.lora]
    _free_output(out, folder=False)
    naming = spec_class(args.model_group, "--model-group").adapter_naming
    adapters = [read_adapter(p, f"--lora {p}", naming) for p in files]
    tensors = concat_loras(adapters, weights, naming)
    rank = int(next(v for k, v in tensors.items() if k.endswith(".alpha")))
    save_adapter_file(tensors, out, {"format": "pt", "ss_network_dim": str(rank), "ss_network_alpha": str(rank),
                                     "wanexp_combined": json.dumps({p.name: w for p, w in zip(files, weights)})})
    print(f"wanexp: combined {len(files)} LoRAs (weights {', '.join(f'{w:g}' for w in weights)}) into {out} "
          f"(rank {rank})", flush=True)
    return out


if __name__ == "__main__":
    main()
