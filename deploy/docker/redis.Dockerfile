# Redis from Debian's redis-server package, on the base image deploy/docker/build-base.sh makes: for
# machines that reach a Debian mirror but not Docker Hub (where redis:7.4-alpine, the image of
# deploy/k8s/base/redis.yaml, comes from). Run like that image: arguments are redis-server's.
#
#   docker build -f deploy/docker/redis.Dockerfile -t card-redis:bookworm deploy/docker
#   docker run -d --network card --network-alias card-redis card-redis:bookworm --save "" --appendonly no
ARG BASE_IMAGE=card-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
USER redis
WORKDIR /var/lib/redis
# No config file, so Redis would start in protected mode and refuse every client that is not on
# loopback: the official image turns it off the same way. Access is the container network's to limit.
ENTRYPOINT ["redis-server", "--protected-mode", "no"]
CMD ["--save", "", "--appendonly", "no"]
EXPOSE 6379
