# Stand-in for postgres:15-bookworm where no container registry can be reached: PostgreSQL 15 from
# Debian bookworm's apt repositories, under the official image's contract (what docker/compose.yaml uses):
#
#   POSTGRES_PASSWORD (required), POSTGRES_USER (default postgres), POSTGRES_DB (default: the user),
#   POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD (default scram-sha-256 for TCP connections);
#   /docker-entrypoint-initdb.d/*.sh|*.sql|*.sql.gz run once, on an empty data directory, over the
#   local socket; data in /var/lib/postgresql/data (PGDATA); initdb -E UTF8 --locale=C.UTF-8;
#   the server runs as the unprivileged user `postgres` (uid 999) and listens on every interface of
#   the container; SIGINT (fast shutdown) stops it.
#
# scripts/standin_images.sh builds it FROM a bookworm root file system made by mmdebstrap.
ARG DEBIAN_IMAGE=localhost/cifar-standin/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV LANG=C.UTF-8 \
    PG_MAJOR=15 \
    PGDATA=/var/lib/postgresql/data
ENV PATH=/usr/lib/postgresql/${PG_MAJOR}/bin:$PATH
RUN groupadd --system --gid 999 postgres \
 && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql --shell /bin/bash postgres \
 && install -d -o postgres -g postgres /var/lib/postgresql \
 && install -d /etc/postgresql-common \
 && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf \
 && apt-get update \
 && apt-get install -y --no-install-recommends "postgresql-${PG_MAJOR}" \
 && rm -rf /var/lib/apt/lists/* \
 && sed -ri "s!^#?(listen_addresses)\s*=\s*\S+.*!\1 = '*'!" "/usr/share/postgresql/${PG_MAJOR}/postgresql.conf.sample" \
 && install -d -o postgres -g postgres -m 3777 /var/run/postgresql \
 && install -d -o postgres -g postgres -m 0700 "$PGDATA" \
 && install -d /docker-entrypoint-initdb.d
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
ENTRYPOINT ["docker-entrypoint.sh"]
STOPSIGNAL SIGINT
EXPOSE 5432
CMD ["postgres"]
