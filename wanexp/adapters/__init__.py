"""Adapters (LoRA, DoRA, LoKr, LoHa) on a model family's DiT, through peft.

- ``kinds``: the adapter component of the ``adapter`` group, peft configs, adding and switching adapters;
- ``naming``: how a family names the modules adapters train and their names in other trainers' files
  (``ModelSpec.adapter_naming``);
- ``files``: reading any trainer's adapter file, checking it fits the run's adapter, copying it in (one path);
- ``export``: writing the run's ComfyUI and diffusers files;
- ``merge``: ComfyUI's arithmetic (patched weights, DoRA), several LoRAs as one;
- ``sizing``: an adapter's parameters and tensors per kind (disk and memory estimates);
- ``peft_compat``: every access to peft's private parts.
"""
from wanexp.adapters.files import AdapterFile, check_fits, copy_into, is_typed_adapter_file, load_adapter_file, read_adapter
from wanexp.adapters.keys import is_adapter_key
from wanexp.adapters.kinds import LohaAdapter, LokrAdapter, LoraAdapter, naming_of, use_adapter
from wanexp.adapters.naming import AdapterNaming

__all__ = ["AdapterFile", "AdapterNaming", "LohaAdapter", "LokrAdapter", "LoraAdapter", "check_fits", "copy_into",
           "is_adapter_key", "is_typed_adapter_file", "load_adapter_file", "naming_of", "read_adapter", "use_adapter"]
