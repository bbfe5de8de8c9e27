#!/bin/sh
# Makes the cluster's keys and passwords, once, at deploy time (nothing of
# them is in the repository):
#   deploy/make-secrets.sh [DIR]                 files in DIR (default deploy/secrets),
#                                                what docker-compose.yml reads
#   deploy/make-secrets.sh --kubernetes NS [DIR] the same files (made if missing), then the
#                                                Secrets and the ConfigMap of public keys in
#                                                namespace NS, created or updated
#                                                (kubectl apply; docs/deploy.md)
# CURVE key pairs come from `llm keygen`, found in this order: $LLM; llm on
# PATH; a build tree (build/clients/c/llm, build/router/llm); else the
# cluster's image, which holds llm in /usr/local/bin, through docker
# ($LLM_IMAGE, default llmcluster:cpu: what the walkthrough builds), so no
# local build is needed.  The Redis password and an API key come from
# /dev/urandom.  Existing files are kept, and the Kubernetes objects are
# applied (create or update): run it again as often as you like.
set -eu
kube=""
if [ "${1:-}" = "--kubernetes" ]; then
    kube="${2:?--kubernetes needs a namespace}"
    shift 2
fi
here="$(dirname "$0")"
dir="${1:-$here/secrets}"
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
dir="$(cd "$dir" && pwd)"

# keygen NAME: DIR/NAME.key and DIR/NAME.pub.
llm="${LLM:-}"
if [ -z "$llm" ]; then
    if command -v llm > /dev/null 2>&1; then llm=llm
    elif [ -x "$here/../build/clients/c/llm" ]; then llm="$here/../build/clients/c/llm"
    elif [ -x "$here/../build/router/llm" ]; then llm="$here/../build/router/llm"
    fi
fi
keygen() {
    if [ -n "$llm" ]; then
        "$llm" keygen --out "$dir" --name "$1"
    elif command -v docker > /dev/null 2>&1; then
        # As this user, so that the files are ours; the image's llm writes them.
        docker run --rm --network none -u "$(id -u):$(id -g)" -v "$dir:/keys" \
            "${LLM_IMAGE:-llmcluster:cpu}" llm keygen --out /keys --name "$1"
    else
        echo "make-secrets: no llm to make keys with: build it, put it on PATH, set LLM=path," \
             "or install docker and build the image (LLM_IMAGE, default llmcluster:cpu)" >&2
        exit 1
    fi
}

for name in router worker gateway operator; do
    [ -f "$dir/$name.key" ] || keygen "$name"
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
# Create or update: the object as kubectl would create it, applied.  A rerun
# (or a rotated file) updates it instead of failing on AlreadyExists.
k() { kubectl -n "$kube" create "$@" --dry-run=client -o yaml | kubectl -n "$kube" apply -f -; }
k secret generic llm-redis --from-file=password="$dir/redis-password"
k secret generic llm-router-key --from-file=router.key="$dir/router.key"
k secret generic llm-worker-key --from-file=worker.key="$dir/worker.key"
k secret generic llm-gateway-key --from-file=gateway.key="$dir/gateway.key"
k secret generic llm-api-keys --from-file=keys="$dir/api-keys"
k configmap llm-public-keys --from-file=router.pub="$dir/router.pub" \
    --from-file=clients.pub="$dir/clients.pub" --from-file=workers.pub="$dir/workers.pub"
echo "make-secrets: Secrets llm-redis, llm-router-key, llm-worker-key, llm-gateway-key, llm-api-keys and ConfigMap llm-public-keys applied in namespace $kube"
