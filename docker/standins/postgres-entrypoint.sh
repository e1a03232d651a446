#!/usr/bin/env bash
# Entry point of the PostgreSQL stand-in image (docker/standins/postgres.Dockerfile): the official
# postgres image's contract, written for Debian's packages.
#
#   postgres [OPTIONS]   as root: own the data directory, then start again as `postgres`;
#                        on an empty data directory: initdb (UTF-8, C.UTF-8), the POSTGRES_DB database,
#                        /docker-entrypoint-initdb.d/* once; then the server in the foreground
#   -OPTION ...          the same, with `postgres` in front
#   anything else        run as given
set -Eeuo pipefail

if [[ ${1:-postgres} == -* ]]; then
    set -- postgres "$@"
fi

if [[ ${1:-} != postgres ]]; then
    exec "$@"
fi

if [[ $(id -u) == 0 ]]; then
    install -d -o postgres -g postgres -m 0700 "$PGDATA"
    chown -R postgres:postgres "$PGDATA"
    install -d -o postgres -g postgres -m 3777 /var/run/postgresql
    exec setpriv --reuid=postgres --regid=postgres --init-groups "${BASH_SOURCE[0]}" "$@"
fi

run_init_file() {
    local file=$1
    case $file in
        *.sh)
            if [[ -x $file ]]; then
                echo "docker-entrypoint: running $file"
                "$file"
            else
                echo "docker-entrypoint: sourcing $file"
                # shellcheck disable=SC1090
                . "$file"
            fi
            ;;
        *.sql)
            echo "docker-entrypoint: running $file"
            psql -v ON_ERROR_STOP=1 --no-psqlrc --dbname "$POSTGRES_DB" -f "$file"
            ;;
        *.sql.gz)
            echo "docker-entrypoint: running $file"
            gunzip -c "$file" | psql -v ON_ERROR_STOP=1 --no-psqlrc --dbname "$POSTGRES_DB"
            ;;
        *) echo "docker-entrypoint: ignoring $file" ;;
    esac
}

if [[ ! -s $PGDATA/PG_VERSION ]]; then
    auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
    if [[ -z ${POSTGRES_PASSWORD:-} && $auth != trust ]]; then
        echo "docker-entrypoint: the database is uninitialized and POSTGRES_PASSWORD is not set" >&2
        exit 1
    fi
    export POSTGRES_USER=${POSTGRES_USER:-postgres}
    export POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
    # shellcheck disable=SC2086  # POSTGRES_INITDB_ARGS holds several words on purpose.
    initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "${POSTGRES_PASSWORD:-}") \
        --encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-} --pgdata="$PGDATA"
    # Local socket: trust (as initdb sets it); TCP from anywhere: a password.
    printf '\nhost all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"

    # A server for the set-up only: no TCP, so nothing connects before the scripts have run.
    pg_ctl --pgdata="$PGDATA" --wait --options="-c listen_addresses='' -p 5432" start
    export PGUSER=$POSTGRES_USER PGPASSWORD=${POSTGRES_PASSWORD:-}
    if [[ $POSTGRES_DB != postgres ]]; then
        psql -v ON_ERROR_STOP=1 --no-psqlrc --dbname postgres --set db="$POSTGRES_DB" <<'SQL'
CREATE DATABASE :"db";
SQL
    fi
    for file in /docker-entrypoint-initdb.d/*; do
        [[ -e $file ]] && run_init_file "$file"
    done
    pg_ctl --pgdata="$PGDATA" --wait --mode=fast stop
    unset PGPASSWORD
    echo "docker-entrypoint: PostgreSQL init process complete; ready for start up."
fi

exec "$@"
