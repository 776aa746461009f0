# SGLang's router (sglang-router from PyPI) for deploy/kubernetes.yaml: one small CPU image.
# From the repository root:
#   docker build -f deploy/router.Dockerfile -t aioserve-router .
# Arguments after the image name go to `python -m sglang_router.launch_router`.
FROM python:3.12-slim
ARG SGLANG_ROUTER=sglang-router==0.3.2
RUN pip install --no-cache-dir "$SGLANG_ROUTER" \
    && useradd --create-home --shell /usr/sbin/nologin router
USER router
EXPOSE 30000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
