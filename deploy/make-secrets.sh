#!/bin/sh
# Makes the cluster's keys and passwords, once, at deploy time (nothing of
# them is in the repository):
#   deploy/make-secrets.sh [DIR]                 files in DIR (default deploy/secrets),
#                                                what docker-compose.yml reads
#   deploy/make-secrets.sh --kubernetes NS [DIR] the same files (made if missing), then the
#                                                Secrets and the ConfigMap of public keys in
#                                                namespace NS (kubectl create; docs/deploy.md)
# CURVE key pairs come from `llm keygen` (LLM, default: llm on PATH, else
# build/clients/c/llm); the Redis password and an API key from /dev/urandom.
# Existing files are kept: run it again to fill in what is missing.
set -eu
kube=""
if [ "${1:-}" = "--kubernetes" ]; then
    kube="${2:?--kubernetes needs a namespace}"
    shift 2
fi
dir="${1:-$(dirname "$0")/secrets}"
llm="${LLM:-}"
if [ -z "$llm" ]; then
    if command -v llm > /dev/null 2>&1; then llm=llm; else llm="$(dirname "$0")/../build/clients/c/llm"; fi
fi
mkdir -p "$dir"
chmod 700 "$dir"
umask 077

for name in router worker gateway operator; do
    if [ ! -f "$dir/$name.key" ]; then
        "$llm" keygen --out "$dir" --name "$name"
    fi
done
# Allowlists: the router admits the gateway and the operator's llm as
# clients, and the workers (one key pair shared by every worker pod).
[ -f "$dir/clients.pub" ] || printf '%s gateway\n%s operator\n' "$(cat "$dir/gateway.pub")" "$(cat "$dir/operator.pub")" > "$dir/clients.pub"
[ -f "$dir/workers.pub" ] || printf '%s workers\n' "$(cat "$dir/worker.pub")" > "$dir/workers.pub"
# Hex: no character that a Redis config line or a URL would need quoted.
[ -f "$dir/redis-password" ] || od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$dir/redis-password"
[ -f "$dir/api-keys" ] || { printf 'sk-'; od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; echo; } > "$dir/api-keys"
# Compose mounts each file into its container as it is, and the containers
# run as other users (10001, Redis 999) than the one who made them: the
# files are readable by all, and the directory (0700) is what keeps them
# private on this host.  Kubernetes copies them into Secrets instead.
chmod 644 "$dir"/*.key "$dir"/*.pub "$dir/redis-password" "$dir/api-keys"
echo "make-secrets: keys and passwords in $dir"

[ -n "$kube" ] || exit 0
k() { kubectl -n "$kube" "$@"; }
k create secret generic llm-redis --from-file=password="$dir/redis-password"
k create secret generic llm-router-key --from-file=router.key="$dir/router.key"
k create secret generic llm-worker-key --from-file=worker.key="$dir/worker.key"
k create secret generic llm-gateway-key --from-file=gateway.key="$dir/gateway.key"
k create secret generic llm-api-keys --from-file=keys="$dir/api-keys"
k create configmap llm-public-keys --from-file=router.pub="$dir/router.pub" \
    --from-file=clients.pub="$dir/clients.pub" --from-file=workers.pub="$dir/workers.pub"
echo "make-secrets: Secrets llm-redis, llm-router-key, llm-worker-key, llm-gateway-key, llm-api-keys and ConfigMap llm-public-keys in namespace $kube"
