# GPU image: CUDA base + CUDA build of torch (>= 2.11) + this project and its bundled corpus.
#   docker build -t ling-fp8 .
#   docker run --gpus all --ipc=host -v $PWD/runs:/app/runs ling-fp8 torchrun --nproc_per_node 8 train.py +exp=fp8_mtp
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    LING_CACHE=/app/.cache/ling_fp8 VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git build-essential \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN pip install "torch>=2.11" --index-url ${TORCH_INDEX}
WORKDIR /app
COPY . /app
RUN bash scripts/setup.sh
# prepare the bundled corpus once at build time, so containers start training immediately
RUN python -m data.prepare +exp=tiny_cpu
CMD ["torchrun", "--nproc_per_node", "1", "train.py", "+exp=tiny_cpu", "train.device=cuda"]
