#!/usr/bin/env bash
# Entry point of the proxy image (docker/proxy/Dockerfile).
#
# Certificates in /certs: kept when server.crt and server.key are there (the user's own, or made
# earlier); otherwise a local CA (ca.crt, ca.key, ten years) and a server certificate it signs for
# localhost, 127.0.0.1, `proxy`, CIFAR_PUBLIC_HOST and CIFAR_PROXY_NAMES (comma-separated). A local
# CA's server certificate is made again when those names change. Clients trust /certs/ca.crt.
# Then SERVE_PASSWORD is hashed (bcrypt) for the served model's sign-in and Caddy runs.
set -euo pipefail

certs=/certs
names=(localhost 127.0.0.1 proxy ${CIFAR_PUBLIC_HOST:-} ${CIFAR_PROXY_NAMES//,/ })

subject_alt_names() {
    local name entries=() seen=" "
    for name in "${names[@]}"; do
        [[ -z $name || $seen == *" $name "* ]] && continue
        seen+="$name "
        if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then entries+=("IP:$name"); else entries+=("DNS:$name"); fi
    done
    local IFS=,
    echo "${entries[*]}"
}

make_certificates() {
    local sans=$1
    umask 077
    if [[ ! -s $certs/ca.key ]]; then
        openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -days 3650 \
            -subj "/CN=cifar stack local CA" -keyout "$certs/ca.key" -out "$certs/ca.crt" \
            -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    fi
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -subj "/CN=${names[0]}" \
        -keyout "$certs/server.key" -out "$certs/server.csr" 2>/dev/null
    openssl x509 -req -in "$certs/server.csr" -CA "$certs/ca.crt" -CAkey "$certs/ca.key" -CAcreateserial \
        -days 825 -out "$certs/server.crt" -extfile <(printf '%s\n' \
            "subjectAltName=$sans" "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
            "extendedKeyUsage=serverAuth" "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid,issuer") 2>/dev/null
    rm -f "$certs/server.csr"
    printf '%s\n' "$sans" > "$certs/names"
    chmod 0644 "$certs/ca.crt" "$certs/server.crt" "$certs/names"
    echo "proxy: certificate for $sans signed by the local CA ($certs/ca.crt)"
}

sans=$(subject_alt_names)
if [[ ! -s $certs/server.crt || ! -s $certs/server.key ]]; then
    make_certificates "$sans"
elif [[ -s $certs/ca.key && $(cat "$certs/names" 2>/dev/null) != "$sans" ]]; then
    make_certificates "$sans"  # Our own CA, and the names changed: a new server certificate.
else
    echo "proxy: using the certificates in $certs"
fi

: "${SERVE_USERNAME:?set SERVE_USERNAME}" "${SERVE_PASSWORD:?set SERVE_PASSWORD}"
SERVE_PASSWORD_HASH=$(printf '%s\n' "$SERVE_PASSWORD" | caddy hash-password)
export SERVE_PASSWORD_HASH
unset SERVE_PASSWORD
exec "$@"
