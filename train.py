"""wanexp training entry point: python train.py [group=option ...] [key=value ...]"""
import hydra
from omegaconf import DictConfig

from wanexp.train import cli


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    cli(cfg)


if __name__ == "__main__":
    main()
