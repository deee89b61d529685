"""Evaluate a checkpoint, or compare runs.

    python eval.py checkpoint=runs/NAME [precision=bf16] [data=bundled] [batches=N] [key=value ...]   (Hydra)
    python eval.py compare RUN_FP8 RUN_BF16 [--out DIR]                    one FP8 run against its BF16 twin
    python eval.py compare --pairs F1:B1 F2:B2 --noise B1:B1b [--out DIR]  several seeds + the noise floor
    python eval.py compare --identical RUN_A RUN_B                         a deterministic rerun: bit-identical?
"""

import sys

from ling.train.launch import strip_local_rank_arg

if len(sys.argv) > 1 and sys.argv[1] == "compare":
    from ling.analysis.compare import main as compare_main  # the comparison needs no model: skip its imports

    compare_main(sys.argv[2:])
    sys.exit(0)

strip_local_rank_arg()  # the deepspeed launcher's --local_rank must not reach Hydra (eval writes no run dir)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ling.analysis.evaluate import run_eval  # noqa: E402


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run_eval(cfg)
    except KeyboardInterrupt:  # Ctrl-C: one line instead of a traceback; the result file is written last, so none
        print("\neval.py: interrupted; no result written", file=sys.stderr, flush=True)
        sys.exit(130)  # 128 + SIGINT, as a shell reports it


if __name__ == "__main__":
    main()
