"""Train a Ling MoE model: `torchrun --nproc_per_node N train.py +exp=tiny_cpu [key=value ...]`."""

from ling.train.logger import quiet_library_noise

quiet_library_noise()  # before DeepSpeed is imported: its import banner comes from rank 0 only

from ling.train.launch import StopRun, add_shared_run_overrides, strip_local_rank_arg  # noqa: E402

strip_local_rank_arg()  # the deepspeed launcher's --local_rank must not reach Hydra
add_shared_run_overrides()  # one uniquely named run dir for all ranks; ranks > 0 write no Hydra files

import sys  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ling.config_check import exit_on_bad_config  # noqa: E402
from ling.train.trainer import train  # noqa: E402


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_bad_config(cfg)  # every problem of the config at once (exit 2), before data, model or engine are built
    try:
        train(cfg)
    except StopRun as stop:  # logged by train(); the exit code tells the launcher (no traceback)
        sys.exit(stop.exit_code)
    except Exception:  # logged by train(), traceback included, to train.log and the console: not again by Hydra
        sys.exit(1)


if __name__ == "__main__":
    main()
