"""The adapter kinds a run trains (``adapter=lora`` with DoRA as ``use_dora``, ``lokr``, ``loha``): their peft
configs, adding one to a frozen transformer, switching adapters without touching ``requires_grad``, and the
``adapter`` group's component, which names its family's module naming (``family``: the model's spec class)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from wanexp.adapters import peft_compat
from wanexp.adapters.keys import adapter_weights, is_adapter_key, peft_config
from wanexp.errors import ConfigError


def add_lora(transformer, rank: int, alpha: float, dropout: float, target_modules: str, adapter_name: str = "default",
             kind: str = "lora", use_dora: bool = False) -> list[str]:
    """Add an adapter (``kind``: lora, lokr, loha; fp32 parameters) on the modules ``target_modules`` (a peft regex:
    ``AdapterNaming.target_regex``) through diffusers' PeftAdapterMixin; return the trainable names."""
    cfg = peft_config(kind, rank, alpha, dropout, target_modules, use_dora)
    before = {n: p.requires_grad for n, p in transformer.named_parameters() if is_adapter_key(n)}
    transformer.add_adapter(cfg, adapter_name=adapter_name)  # peft's set_adapter freezes the other adapters
    names = []
    for name, p in transformer.named_parameters():
        mine = is_adapter_key(name) and (f".{adapter_name}." in name or name.endswith(f".{adapter_name}"))
        if mine:
            p.data = p.data.float()
            p.requires_grad_(True)
            names.append(name)
        elif not is_adapter_key(name):  # the base stays frozen
            p.requires_grad_(False)
        else:  # other adapters keep their own settings
            p.requires_grad_(before[name])
    return names


@contextmanager
def use_adapter(modules, name: str | None):
    """Run ``modules`` (transformers) with only adapter ``name`` active, or with every adapter off (``None``: the
    frozen base, e.g. a distillation teacher); restores the previous state on exit.

    Unlike peft's ``set_adapter``/``disable_adapters`` this never touches ``requires_grad``: the trainable set stays
    what the optimizers and DDP were built with. Activation checkpointing recomputes a block's forward during backward
    under whatever adapter is active then, so a backward must run inside the same ``use_adapter`` as its forward."""
    layers = peft_compat.tuner_layers(modules)
    saved = [peft_compat.adapter_switch(layer) for layer in layers]
    for layer in layers:
        peft_compat.set_adapter_switch(layer, None if name is None else [name], name is None)
    try:
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved):
            peft_compat.set_adapter_switch(layer, active, disabled)


class LoraAdapter:
    """The ``adapter=lora`` component (DoRA with ``use_dora``): what is trained on the frozen base of every trained
    expert. ``adapter=lokr`` and ``adapter=loha`` are the same component with another peft adapter kind."""

    kind = "lora"

    def __init__(self, *, name: str, rank: int, alpha: float, dropout: float, targets: list[str],
                 attention: list[str] | None, init_from: str | None, use_dora: bool = False, family: str | None = None):
        """The arguments are the ``adapter`` group (conf/adapter/*.yaml, typed by config.schema.LoraConfig);
        ``family``: the model's spec class (``${model._target_}``), whose ``adapter_naming`` names the modules."""
        from wanexp.adapters.files import check_fits, read_adapter

        self.name, self.rank, self.alpha, self.dropout = name, int(rank), float(alpha), float(dropout)
        self.use_dora = bool(use_dora)
        if self.use_dora and self.kind != "lora":
            raise ConfigError(f"adapter.use_dora=true: DoRA is a LoRA variant, adapter={self.kind} has none; set "
                              "adapter.use_dora=false or adapter=lora")
        self.naming = naming_of(family)
        # attention null: every attention layer the family names (Wan: self, cross; S2V: also its audio layers)
        self.targets, self.init_from = list(targets), init_from
        self.attention = list(self.naming.attention) if attention is None else list(attention)
        self.target_modules = self.naming.target_regex(self.targets, self.attention)  # unknown names fail here
        self._file = None
        if init_from:  # read and checked here too: a file that cannot fit fails before any weight loads
            what = f"adapter.init_from={init_from}"
            self._file = read_adapter(init_from, what, self.naming)
            check_fits(self._file, self, what)

    @staticmethod
    def is_param(key: str) -> bool:
        """Whether a state-dict key is an adapter parameter (of any kind)."""
        return is_adapter_key(key)

    @property
    def label(self) -> str:
        """The type as users name it: lora, dora, lokr, loha."""
        return "dora" if self.use_dora else self.kind

    def apply(self, transformer, adapter_name: str = "default") -> list[str]:
        """Add the adapter (fp32, trainable) to a frozen transformer, from ``init_from`` if set; its parameter names."""
        from wanexp.adapters.files import copy_into

        names = add_lora(transformer, self.rank, self.alpha, self.dropout, self.target_modules, adapter_name,
                         kind=self.kind, use_dora=self.use_dora)
        if self._file is not None:
            copy_into(transformer, self._file, adapter_name, what=f"adapter.init_from={self.init_from}")
        return names

    def export(self, state_dict: dict, prefix: str, transformer, out_dir: Path, stem: str,
               adapter_name: str = "default", meta: dict | None = None):
        """Write one expert's adapter files (ComfyUI, plus diffusers where diffusers loads the kind) from the keys of
        a (checkpoint) state dict under ``prefix`` (the transformer's name in the module)."""
        from wanexp.adapters.export import export_adapter

        sd = adapter_weights(state_dict, prefix, adapter_name)
        base = (lambda module: base_weight(transformer, module)) if self.use_dora else None
        return export_adapter(sd, self.kind, lora_config_dict(transformer, adapter_name), self.naming, out_dir, stem,
                              meta=dict(meta or {}, wanexp_targets=",".join(self.targets), wanexp_adapter=self.label),
                              base=base)


class LokrAdapter(LoraAdapter):
    """``adapter=lokr``: peft's LoKr (a Kronecker product of two small factors per module)."""

    kind = "lokr"


class LohaAdapter(LoraAdapter):
    """``adapter=loha``: peft's LoHa (the Hadamard product of two low-rank products per module)."""

    kind = "loha"


def base_weight(transformer, module: str) -> torch.Tensor:
    """The frozen base weight of adapted ``module`` as a full fp32 CPU tensor (DoRA's export needs its row norms)."""
    w = transformer.get_submodule(module).get_base_layer().weight
    if type(w).__name__ == "DTensor" or type(w.data).__name__ == "DTensor":
        raise RuntimeError(f"{module}: a sharded base weight; DoRA export needs the whole weight on this rank")
    return w.detach().to("cpu", torch.float32)


def lora_config_dict(transformer, adapter_name: str = "default") -> dict:
    cfg = transformer.peft_config[adapter_name].to_dict()
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


def naming_of(family: str | None):
    """The adapter naming (``ModelSpec.adapter_naming``) of the spec class ``family`` names; one line when the
    model's family gives none."""
    from hydra.utils import get_class

    if family is None:
        raise ConfigError("adapter.family is not set: it names the model's spec class (adapter.family="
                          "${model._target_} in the adapter group)")
    naming = getattr(get_class(family), "adapter_naming", None)
    if naming is None:
        raise ConfigError(f"model's family {family} gives no adapter naming (ModelSpec.adapter_naming): it cannot "
                          "train adapters")
    return naming
