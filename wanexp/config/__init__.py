"""Configuration: typed schemas in Hydra's ConfigStore, composition, and the checks that run before anything loads.

    schema.py  dataclass schemas of every group (types, defaults, allowed values, ranges) + check_schema
    rules.py   rules across groups (boundary vs dense model, the model's frame rule, resolution multiples, ...) + path checks
    messages.py  a composition error as one line
    folders.py   the shipped conf/ and the user's config folder (./conf, $WANEXP_CONFIG_DIR) on Hydra's search path
    dataset_files.py  musubi-tuner / diffusion-pipe TOML and ai-toolkit YAML dataset files as data.datasets

Only this package and ``wanexp/train.py`` touch Hydra.
"""
from __future__ import annotations

from functools import cache

from omegaconf import DictConfig

from wanexp.config.folders import CONF_DIR
from wanexp.config.messages import one_line_error  # noqa: F401  (the package's API)
from wanexp.config.rules import check_boundary, check_paths, check_rules
from wanexp.config.schema import check_schema, register
from wanexp.errors import ConfigError

__all__ = ["CONF_DIR", "ConfigError", "check_config", "check_paths", "compose", "model_group", "model_group_files",
           "one_line_error", "register"]


def check_config(cfg: DictConfig, model_folder: bool = False) -> None:
    """Every check of the composed config that needs no file: schema constraints, then cross-group rules.
    ``model_folder``: also whether ``model.path`` exists, before the rules import the objective's class (and torch)."""
    check_boundary(cfg)
    check_schema(cfg)
    check_rules(cfg, model_folder)


@cache
def optional_groups() -> tuple[str, ...]:
    """The groups ``conf/train.yaml`` lists as optional (``- optional hw: null``): Hydra skips an option of one that
    has no file instead of failing, so :func:`check_optional_groups` does."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml")).get("defaults", [])
    return tuple(k.split()[1] for d in defaults if isinstance(d, dict) for k in d if k.startswith("optional "))


def check_optional_groups(overrides) -> None:
    """A command-line ``group=name`` (or ``group=a,b`` of a sweep) of an optional group without its file is one line
    naming the options and the folders looked in, before anything composes."""
    from wanexp.config.folders import config_roots

    groups = set(optional_groups())
    roots = config_roots(overrides)  # the shipped conf/ and the user's config folders
    for arg in overrides:
        key, eq, value = str(arg).lstrip("+").partition("=")
        if not eq or key not in groups or "(" in value:
            continue
        have = sorted({f.stem for root in roots for f in (root / key).glob("*.yaml")})
        for name in (v.strip() for v in value.split(",")):
            if name not in have and name != "null":
                raise ConfigError(f"{key}={name}: no such {key} option (conf/{key}/{name}.yaml{looked_in(roots, key)})"
                                  f"; the options: {', '.join(have)}")


def looked_in(roots, group: str) -> str:
    """``, nor in DIR/group, ...`` for the folders beside the shipped conf/ that options were looked up in."""
    others = [str(r / group) for r in roots if r.resolve() != CONF_DIR]
    return f", nor in {', '.join(others)}" if others else ""


def compose(overrides: list[str] | tuple[str, ...] = (), return_hydra_config: bool = False) -> DictConfig:
    """Compose ``conf/train.yaml`` with overrides as ``python train.py`` would (for tests and tools): the user's config
    folder (wanexp/config/folders.py) on the search path, a dataset file in ``data.datasets`` read
    (wanexp/config/dataset_files.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from wanexp.config.dataset_files import apply_dataset_file
    from wanexp.config.folders import with_user_config_dir

    given = list(overrides)
    overrides = with_user_config_dir(given)
    check_optional_groups(overrides)
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=return_hydra_config)
    apply_dataset_file(cfg, given)
    return cfg


def model_group(name: str, flag: str) -> DictConfig:
    """The ``model`` group ``conf/model/<name>.yaml`` composed (its defaults and schema applied), for a command's
    ``--model`` and the like; a name with no such file is one line naming ``flag``."""
    from hydra.errors import HydraException

    try:
        return compose([f"model={name}"]).model
    except HydraException:
        raise ConfigError(f"{flag} {name}: no such model group (conf/model/{name}.yaml)") from None


def model_group_files() -> dict[str, DictConfig]:
    """Each model group's own file (``conf/model/<name>.yaml``, and the user's config folder's) by name, as written:
    its defaults not applied (read in milliseconds, where composing every group takes seconds)."""
    from omegaconf import OmegaConf

    from wanexp.config.folders import config_roots, with_user_config_dir

    files = {}
    for root in reversed(config_roots(with_user_config_dir([]))):  # the first folder's file wins, as in Hydra
        files.update({f.stem: f for f in (root / "model").glob("*.yaml")})
    return {name: OmegaConf.load(files[name]) for name in sorted(files)}
