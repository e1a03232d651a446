# Stand-in for python:3.11-slim-bookworm where no container registry can be reached (air-gapped sites,
# this project's CI): Debian bookworm's own Python 3.11 from the apt repositories.
# scripts/standin_images.sh builds it FROM a bookworm root file system made by mmdebstrap.
#
# The contract docker/Dockerfile relies on, as in the official image: `python` and `python3` on PATH
# (3.11), `python -m venv` with pip, CA certificates, root as the build user, UTF-8 locale.
ARG DEBIAN_IMAGE=localhost/cifar-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV LANG=C.UTF-8
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python --version
CMD ["python3"]
