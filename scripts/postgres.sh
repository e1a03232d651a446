#!/usr/bin/env bash
# PostgreSQL for tests and local runs, without Docker.
#
#   scripts/postgres.sh install            install the server via apt if it is missing (idempotent; fast when present)
#   scripts/postgres.sh bindir             print the directory holding initdb/pg_ctl/postgres
#   scripts/postgres.sh start DIR PORT     init (first time) and start a throwaway cluster in DIR on 127.0.0.1:PORT
#   scripts/postgres.sh stop DIR           stop that cluster (fast shutdown)
#   scripts/postgres.sh status DIR         exit 0 if that cluster is running
#
# `start` reads POSTGRES_USER (default: postgres) and POSTGRES_PASSWORD (required), as the postgres image does.
set -euo pipefail

die() { echo "postgres.sh: $*" >&2; exit 1; }

bindir() {
    local dir
    # Newest major version first; Debian keeps each one under /usr/lib/postgresql/<major>/bin.
    for dir in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -t/ -k5 -V -r); do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" && -x "$dir/postgres" ]]; then
            echo "$dir"
            return 0
        fi
    done
    if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        dirname "$(command -v initdb)"
        return 0
    fi
    return 1
}

install() {
    if bindir >/dev/null && command -v psql >/dev/null; then
        return 0
    fi
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || die "PostgreSQL is missing and installing it needs root (or sudo)"
        sudo=(sudo)
    fi
    command -v apt-get >/dev/null || die "PostgreSQL is missing and this is not a Debian/Ubuntu machine: install it with your package manager"
    echo "postgres.sh: installing PostgreSQL with apt-get" >&2
    local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -qq --no-install-recommends
               -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    "${apt[@]}" update >/dev/null
    # The server package would also create and start a system cluster on port 5432; we only want the
    # binaries. Like the official postgres image: install postgresql-common, switch that off, then the rest.
    "${apt[@]}" install postgresql-common >/dev/null
    "${sudo[@]}" sed -ri 's/^#?[[:space:]]*create_main_cluster[[:space:]]*=.*$/create_main_cluster = false/' \
        /etc/postgresql-common/createcluster.conf
    "${apt[@]}" install postgresql postgresql-client >/dev/null
    bindir >/dev/null || die "apt-get installed postgresql but no initdb/pg_ctl was found"
}

# Runs a command as the cluster's owner: `postgres` when we are root (the server refuses to run as root;
# the Debian package creates that system user), ourselves otherwise.
as_owner() {
    if [[ $(id -u) -eq 0 ]]; then
        id postgres >/dev/null 2>&1 || die "running as root needs the 'postgres' system user (scripts/postgres.sh install creates it)"
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

start() {
    local dir=${1:?usage: postgres.sh start DIR PORT} port=${2:?usage: postgres.sh start DIR PORT}
    local user=${POSTGRES_USER:-postgres}  # The superuser, with POSTGRES_PASSWORD (scram-sha-256 over TCP).
    [[ -n ${POSTGRES_PASSWORD:-} ]] || die "set POSTGRES_PASSWORD"
    [[ $port =~ ^[0-9]+$ ]] || die "PORT must be a number, got '$port'"
    local bin
    bin=$(bindir) || die "PostgreSQL is not installed: run scripts/postgres.sh install"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [[ -f $dir/data/PG_VERSION ]] && as_owner "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        echo "postgresql://$user@127.0.0.1:$port (already running, data in $dir/data)"
        return 0
    fi
    if [[ $(id -u) -eq 0 ]]; then
        chown postgres: "$dir"
        chmod 700 "$dir"
        as_owner test -x "$dir" || die "user postgres cannot reach $dir: put it somewhere world-traversable, such as /tmp"
    fi
    if [[ ! -f $dir/data/PG_VERSION ]]; then
        local pwfile=$dir/.pwfile
        (umask 077 && printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile")
        [[ $(id -u) -eq 0 ]] && chown postgres: "$pwfile"
        as_owner "$bin/initdb" -D "$dir/data" -U "$user" --pwfile="$pwfile" --auth-host=scram-sha-256 \
            --auth-local=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
            || { rm -f "$pwfile"; cat "$dir/initdb.log" >&2; die "initdb failed"; }
        rm -f "$pwfile"
    fi
    # Listen on loopback only; the socket lives in the cluster directory, not /var/run/postgresql.
    # Durability is off (fsync, synchronous_commit, full_page_writes): the cluster is for tests.
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories='$dir' -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start >/dev/null || { tail -n 30 "$dir/postgres.log" >&2; die "the server did not start"; }
    echo "postgresql://$user@127.0.0.1:$port (data in $dir/data, log in $dir/postgres.log)"
}

stop() {
    local dir=${1:?usage: postgres.sh stop DIR}
    local bin
    bin=$(bindir) || die "PostgreSQL is not installed"
    if [[ -f $dir/data/postmaster.pid ]]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
    fi
}

status() {
    local dir=${1:?usage: postgres.sh status DIR}
    local bin
    bin=$(bindir) || return 1
    as_owner "$bin/pg_ctl" -D "$dir/data" status >/dev/null
}

command=${1:-}
shift || true
case $command in
    install) install ;;
    bindir) bindir || die "PostgreSQL is not installed" ;;
    start) start "$@" ;;
    stop) stop "$@" ;;
    status) status "$@" ;;
    *) die "usage: $0 install | bindir | start DIR PORT | stop DIR | status DIR" ;;
esac
