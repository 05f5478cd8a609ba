# FerryMQ broker image: small (python slim, no compiler in the final stage), runs as a non-root
# user, keeps its data on a volume, health-checked on the HTTP port's /healthz.
#   docker build -t ferrymq .
#   docker run -p 9876:9876 -p 9877:9877 -v ferrymq-data:/var/lib/ferrymq \
#       -v ./users:/etc/ferrymq/users:ro -e FERRYMQ_USERS_FILE=/etc/ferrymq/users ferrymq
# docs/operations.md ("Docker and compose") says more.

FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN groupadd --system --gid 10001 ferrymq \
    && useradd --system --uid 10001 --gid ferrymq --home-dir /var/lib/ferrymq --no-create-home ferrymq \
    && mkdir -p /var/lib/ferrymq \
    && chown ferrymq:ferrymq /var/lib/ferrymq
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-compile /wheels/*.whl && rm -rf /wheels
# every setting is also a FERRYMQ_<SETTING> variable (docs/configuration.md); the broker
# refuses a non-loopback host without a users file unless FERRYMQ_INSECURE=true
ENV FERRYMQ_HOST=0.0.0.0 \
    FERRYMQ_DATA_DIR=/var/lib/ferrymq \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/ferrymq
VOLUME ["/var/lib/ferrymq"]
EXPOSE 9876 9877 9092
# python's urllib, so the image needs no curl; /healthz answers while the event loop runs
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9877/healthz', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["ferrymq", "broker"]
