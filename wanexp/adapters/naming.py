"""How a model family names what its adapters train: the one object (``ModelSpec.adapter_naming``) the adapter code
asks for module names, so no table of a family's module names lives outside its package.

A family's DiT has a list of repeated blocks (``blocks``), in each some attention layers of the kinds users pick
with ``adapter.attention`` (``attention``: kind -> the layer's attribute), each with the projections users pick with
``adapter.targets`` (``projections``: alias -> the projection's module path in the layer), and the block-level
linears ``adapter.targets`` may also name (``feedforward``: alias -> module path in the block). Adapter files of
other trainers name the same modules the original release's way, ``blocks.N.<original attention>.<alias>`` and
``blocks.N.<alias>`` (ComfyUI under ``diffusion_model.``, kohya as ``lora_unet_<blocks>_N_<...>`` with underscores):
``original_attention`` maps a kind to that name. ``convert_lora``: the family's converter of foreign LoRA namings to
peft's (diffusers ships one per family), or None: the generic reader of the names above.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from wanexp.errors import ConfigError

COMFY_PREFIX = "diffusion_model."  # ComfyUI's (and the original releases') prefix of a DiT's keys
KOHYA_PREFIX = "lora_unet_"


class AdapterNaming:
    def __init__(self, *, blocks: str, attention: dict[str, str], projections: dict[str, str],
                 feedforward: dict[str, str], original_attention: dict[str, str], formats: str,
                 convert_lora: Callable | None = None):
        self.blocks, self.attention, self.projections = blocks, dict(attention), dict(projections)
        self.feedforward, self.original_attention = dict(feedforward), dict(original_attention)
        self.formats, self.convert_lora = formats, convert_lora
        self.allowed = list(self.projections) + list(self.feedforward)  # the aliases adapter.targets takes
        self.aliases = {v: k for k, v in {**self.projections, **self.feedforward}.items()}  # module names taken too
        b, esc = re.escape(blocks), lambda names: "|".join(re.escape(n) for n in names)
        self.module_re = re.compile(rf"^{b}\.(\d+)\.(?:({esc(self.attention.values())})\.({esc(self.projections.values())})"
                                    rf"|({esc(self.feedforward.values())}))$")
        self.original_re = re.compile(rf"^{b}\.(\d+)\.(?:({esc(self.original_attention.values())})\.("
                                      rf"{esc(self.projections)})|({esc(self.feedforward)}))$")
        under = lambda names: "|".join(re.escape(n.replace(".", "_")) for n in names)  # noqa: E731
        self.kohya_re = re.compile(rf"^{KOHYA_PREFIX}{re.escape(blocks.replace('.', '_'))}_(\d+)_(?:("
                                   rf"{under(self.original_attention.values())})_({under(self.projections)})|("
                                   rf"{under(self.feedforward)}))\.(.+)$")
        # one module of every kind an adapter can train, in the order messages list them
        self.probe_modules = [f"{blocks}.0.{a}.{p}" for a in self.attention.values() for p in
                              self.projections.values()] + [f"{blocks}.0.{f}" for f in self.feedforward.values()]

    # ---- the config's names -> peft's target_modules --------------------------------------------------------
    def target_regex(self, targets: list[str], attention: list[str] | None) -> str:
        """A peft ``target_modules`` regex (full match on module names) for ``adapter.targets``/``attention`` (None:
        every attention kind the family names)."""
        attention = list(self.attention) if attention is None else attention
        names = []
        for t in targets:
            t = self.aliases.get(t, t)
            if t not in self.allowed:
                raise ConfigError(f"adapter.targets: unknown target {t!r}; allowed: {', '.join(self.allowed)} (or "
                                  f"their module names {', '.join(self.aliases)})")
            names.append(t)
        for a in attention:
            if a not in self.attention:
                raise ConfigError(f"adapter.attention: unknown value {a!r}; allowed: {', '.join(self.attention)}")
        b, alts = re.escape(self.blocks), []
        attn = [re.escape(self.projections[t]) for t in names if t in self.projections]
        if attn and attention:
            layers = "|".join(re.escape(self.attention[a]) for a in attention)
            alts.append(rf"{b}\.\d+\.({layers})\.({'|'.join(attn)})")
        ffn = [re.escape(self.feedforward[t]) for t in names if t in self.feedforward]
        if ffn:
            alts.append(rf"{b}\.\d+\.({'|'.join(ffn)})")
        if not alts:
            raise ConfigError(f"adapter: targets and attention select no module; e.g. targets=[{','.join(self.allowed)}]")
        return "^(" + "|".join(alts) + ")$"

    def kind(self, module: str) -> str | None:
        """The kind of a module an adapter can train, ``<original attention>.<alias>`` or, for a block-level one,
        its alias; None for any other module."""
        m = self.module_re.match(module)
        if m is None:
            return None
        if m.group(2):
            kind = next(k for k, v in self.attention.items() if v == m.group(2))
            return f"{self.original_attention[kind]}.{self.aliases[m.group(3)]}"
        return self.aliases[m.group(4)]

    def configured_kinds(self, targets: list[str], attention: list[str] | None) -> list[str]:
        """The module kinds (see :meth:`kind`) an adapter with these ``targets``/``attention`` trains, in order."""
        rx = re.compile(self.target_regex(targets, attention))
        return [self.kind(m) for m in self.probe_modules if rx.fullmatch(m)]

    def setting_for(self, kinds: set[str]) -> str:
        """The adapter.targets/attention that select ``kinds``, or the closest with a note that none selects them."""
        order = [self.kind(m) for m in self.probe_modules]
        targets = [t for t in self.allowed if any(k.split(".", 1)[-1] == t or k == t for k in kinds)]
        attention = [a for a, orig in self.original_attention.items() if any(k.startswith(f"{orig}.") for k in kinds)]
        setting = f"adapter.targets=[{','.join(targets)}] adapter.attention=[{','.join(attention)}]"
        if [k for k in order if k in kinds] == self.configured_kinds(targets, attention):
            return f"set {setting}"
        return f"no adapter.targets/attention selects exactly these (the closest: {setting})"

    # ---- module names <-> the original release's ------------------------------------------------------------
    def to_original(self, module: str) -> str:
        return self._rename(module, self.module_re, self.attention, self.original_attention, self.aliases,
                            self.aliases, "no original name for adapter module")

    def from_original(self, name: str) -> str:
        return self._rename(name, self.original_re, self.original_attention, self.attention, self.projections,
                            self.feedforward, "no module for the original adapter name")

    def _rename(self, name: str, pattern, kinds_from: dict, kinds_to: dict, projections: dict, feedforward: dict,
                missing: str) -> str:
        """``name`` (matched by ``pattern``) in the other naming: its attention layer's kind through ``kinds_from``
        to ``kinds_to``, its projection or block-level linear through ``projections``/``feedforward``."""
        m = pattern.match(name)
        if m is None:
            raise ValueError(f"{missing} {name!r}")
        if m.group(2):
            kind = next(k for k, v in kinds_from.items() if v == m.group(2))
            return f"{self.blocks}.{m.group(1)}.{kinds_to[kind]}.{projections[m.group(3)]}"
        return f"{self.blocks}.{m.group(1)}.{feedforward[m.group(4)]}"

    def kohya_to_comfy(self, key: str) -> str:
        """kohya/musubi-tuner/LyCORIS module names (``lora_unet_<blocks>_0_<original attention>_<alias>.<param>``,
        dots as underscores) -> ComfyUI's (``diffusion_model.<blocks>.0.<original attention>.<alias>.<param>``);
        other keys as they are."""
        m = self.kohya_re.match(key)
        if m is None:
            return key
        block, attn, proj, ffn, param = m.groups()
        if attn:
            attn = next(v for v in self.original_attention.values() if v.replace(".", "_") == attn)
            module = f"{attn}.{next(p for p in self.projections if p.replace('.', '_') == proj)}"
        else:
            module = next(f for f in self.feedforward if f.replace(".", "_") == ffn)
        return f"{COMFY_PREFIX}{self.blocks}.{block}.{module}.{param}"
