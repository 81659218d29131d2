"""Each optimizer by name (optim=adamw8bit|prodigy|came|adafactor) trains the tiny model through wanexp.train.run, and
a run stopped at a checkpoint and resumed ends with the uninterrupted run's LoRA bit for bit (the optimizer's state
is in the checkpoint)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose_cfg
from wanexp.train import run

OPTIMIZERS = {  # name: (its package, its overrides for the tiny model)
    "adamw8bit": ("bitsandbytes", ["optim.optimizer.min_8bit_size=16"]),  # the tiny LoRA's tensors in 8 bits
    "prodigy": ("prodigyopt", ["optim.lr=1.0"]),  # a multiplier of its estimate (experiment=demo sets 1e-3)
    "came": ("came_pytorch", []),
    "adafactor": ("transformers", []),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_trains_and_resumes_bit_for_bit(name, shared_dir, tmp_path):
    package, extra = OPTIMIZERS[name]
    pytest.importorskip(package)
    common = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
              "data.use_cache=false", "trainer.log_every_n_steps=1", "callbacks.progress=null",
              "callbacks.checkpoint.every_n_train_steps=2", "optim.scheduler=constant", "optim.warmup_steps=0",
              f"optim={name}", *extra]
    ref = run(compose_cfg([*common, "trainer.max_steps=4", f"paths.output_dir={tmp_path / 'ref'}"]))
    assert type(ref["trainer"].optimizers[0]).__name__ == {"adamw8bit": "AdamW8bit", "prodigy": "Prodigy",
                                                           "came": "CAME", "adafactor": "Adafactor"}[name]
    out = tmp_path / "resumed"
    run(compose_cfg([*common, "trainer.max_steps=2", f"paths.output_dir={out}"]))
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["optimizer_states"][0]["state"], "the optimizer's state is in the checkpoint"
    if name == "adamw8bit":
        state = next(iter(ckpt["optimizer_states"][0]["state"].values()))
        packed = state.get("__bnb_optimizer_quant_state__", state)
        assert packed["state1"].dtype == torch.uint8  # 8-bit moments (on the CPU)
    run(compose_cfg([*common, "trainer.max_steps=4", f"paths.output_dir={out}", "resume=last"]))
    for f in ("tiny_lora_diffusers.safetensors", "tiny_lora_comfyui.safetensors"):
        a, b = load_file(tmp_path / "ref" / "lora" / "final" / f), load_file(out / "lora" / "final" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{name}: {f} differs after resume"
        assert all(torch.isfinite(v).all() for v in a.values())
    trained = load_file(tmp_path / "ref" / "lora" / "final" / "tiny_lora_diffusers.safetensors")
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), f"{name} did not train the LoRA"
