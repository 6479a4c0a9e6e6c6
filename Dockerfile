# The image the KubeRay manifests name (ghcr.io/specserve/specserve:0.1.0). CPU by default; for GPU nodes:
#   docker build --build-arg BASE=rayproject/ray:2.60.0-py311-gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t specserve:gpu .
ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /opt/specserve
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users workers ./workers
COPY --chown=ray:users protos ./protos
COPY --chown=ray:users src ./src
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==2.13.0 \
 && pip install --no-cache-dir . \
 && python -c "import specserve.cluster.serve.serve_app"
# Models are mounted at /models (see manifests/); nothing is downloaded at run time.
ENV SPECSERVE_HOME=/models/specserve-home
