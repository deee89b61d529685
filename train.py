"""Train a Ling MoE model: `torchrun --nproc_per_node N train.py +exp=tiny_cpu [key=value ...]`."""

from ling.launch import add_shared_run_overrides, strip_local_rank_arg

strip_local_rank_arg()  # the deepspeed launcher's --local_rank must not reach Hydra
add_shared_run_overrides()  # one run dir for all ranks; ranks > 0 write no Hydra files

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ling.trainer import train

    train(cfg)


if __name__ == "__main__":
    main()
