# lightning-hybrid on a CUDA PyTorch image, for the multi-node recipes (SLURM with a container runtime, Kubernetes).
#
#   docker build -t registry.example.com/lightning-hybrid:0.1.0 .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<yy.mm>-py3 -t ... .   # NGC's build, if its torch >= 2.11
#   docker push registry.example.com/lightning-hybrid:0.1.0
#
# The image holds the package and the recipes under /opt/lightning-hybrid; checkpoints, logs and data live on a
# shared volume mounted into it (see deploy/kubernetes/qwen2.5-72b-pytorchjob.yaml and docs/deployment.md).

# Any image with a CUDA build of torch >= 2.11 works. "devel" (not "runtime"): torch.compile needs a C compiler and
# the CUDA headers. Blackwell (B200/B300) needs CUDA >= 12.8.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# RDMA user space for NCCL's InfiniBand/RoCE transport (libibverbs with the mlx5 provider, librdmacm) and the tools
# to inspect the fabric from inside a pod (ibstat, ibv_devinfo). The kernel driver and the devices come from the host.
RUN apt-get update \
    && apt-get install -y --no-install-recommends rdma-core ibverbs-providers libibverbs1 librdmacm1 \
       ibverbs-utils infiniband-diags iproute2 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/lightning-hybrid
COPY pyproject.toml README.md ./
COPY lightning_hybrid ./lightning_hybrid
COPY recipes ./recipes

# Install the package against the torch of the base image: the constraint stops pip from replacing that CUDA build
# with another torch wheel. nvidia-ml-py lets `lightning-hybrid preflight` read NVLink, PCIe, ECC and clock health.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt . nvidia-ml-py \
    && rm /tmp/torch-constraint.txt \
    && lightning-hybrid --help > /dev/null

# ---- NCCL over InfiniBand / RoCE. Defaults for a typical HGX node with one ConnectX NIC per GPU; override at run
# time (`docker run -e`, the pod's env) where the fabric differs. docs/deployment.md explains each one.
# HCAs NCCL may use: every mlx5 device (ConnectX-7/8). A list like mlx5_0,mlx5_1 or ^mlx5_8 narrows it.
ENV NCCL_IB_HCA=mlx5
# Interfaces for NCCL's bootstrap and socket fallback: anything but loopback and the docker bridge.
ENV NCCL_SOCKET_IFNAME=^lo,docker
# RoCE v2: the GID index of the RoCE v2 address (often 3); native InfiniBand ignores it.
ENV NCCL_IB_GID_INDEX=3
# InfiniBand retransmit timeout 4.096 us x 2^22 (~17 s) and retry count: survive short fabric disturbances
# (link flaps, switch reboots) instead of failing a collective.
ENV NCCL_IB_TIMEOUT=22
ENV NCCL_IB_RETRY_CNT=7
# A collective that fails or exceeds the strategy's timeout aborts the process instead of hanging the job, so the
# restart policy (torchrun --max-restarts, the pod's OnFailure, SLURM requeue) can act.
ENV TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# WARN: errors only. Set INFO once to see the chosen transports (NVLS/NVLink SHARP, IB, GPUDirect RDMA).
ENV NCCL_DEBUG=WARN
# ---- preemption: torchrun forwards SIGTERM and SIGUSR1 to the training processes and waits this long for their
# checkpoint (FaultTolerantCheckpoint saves and exits with code 75). Keep it below the pod's grace period.
ENV TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
ENV TORCH_ELASTIC_SHUTDOWN_TIMEOUT=150
ENV PYTHONUNBUFFERED=1
ENV OMP_NUM_THREADS=8

CMD ["lightning-hybrid", "--help"]
