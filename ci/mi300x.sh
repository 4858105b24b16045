#!/usr/bin/env bash
# MI300X CI: the real Primus-Turbo kernels in AMD's own image, as users run them. On any MI300X or
# MI325X host with Docker, from a checkout:
#
#     ci/mi300x.sh rocm/primus:v26.5@sha256:<digest>      (or MI300X_IMAGE=<image> ci/mi300x.sh)
#
# The image is named by digest, since a tag can move: `docker buildx imagetools inspect
# rocm/primus:v26.5` prints it. The checkout is mounted read-only and ci/mi300x-image.sh runs in the
# container (on a copy of it); results go to $ARTIFACTS (default artifacts/mi300x), printed at the
# end. On a node without Docker, run ci/mi300x-image.sh in the image with your container runtime.
#
# `ci/mi300x.sh --check [IMAGE]` only checks that the image is named by digest (the first job of the
# mi300x workflow, which refuses to start the MI300X job otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

check_only=false
if [[ ${1:-} == --check ]]; then
    check_only=true
    shift
fi
image=${1:-${MI300X_IMAGE:-}}
if [[ ! $image =~ @sha256:[0-9a-f]{64}$ ]]; then
    why="the MI300X CI needs AMD's image named by digest, e.g. rocm/primus:v26.5@sha256:<digest>"
    why+=" (\`docker buildx imagetools inspect rocm/primus:v26.5\` prints it), as an argument or in"
    why+=" MI300X_IMAGE; in GitHub, set the repository variable MI300X_IMAGE."
    if [[ -n $image ]]; then why+=" Got '$image'."; else why+=" It is not set."; fi
    if [[ ${GITHUB_ACTIONS:-} == true ]]; then echo "::error title=MI300X_IMAGE::$why"; fi
    echo "ci/mi300x.sh: $why" >&2
    exit 2
fi
if $check_only; then
    echo "image: $image"
    exit 0
fi

artifacts=${ARTIFACTS:-artifacts/mi300x}
mkdir -p "$artifacts"
artifacts=$(cd "$artifacts" && pwd)
status=0
# The GPUs (all of them, or those HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES name here); bash runs
# the script in place of the image's entrypoint, as GitHub's container jobs run their steps.
docker run --rm \
    --device=/dev/kfd --device=/dev/dri --group-add video --ipc=host --shm-size=16g \
    --security-opt seccomp=unconfined --env HIP_VISIBLE_DEVICES --env ROCR_VISIBLE_DEVICES \
    --volume "$PWD:/src:ro" --volume "$artifacts:/artifacts" \
    --env ARTIFACTS=/artifacts --env OWNER="$(id -u):$(id -g)" \
    --entrypoint bash "$image" /src/ci/mi300x-image.sh || status=$?
echo "MI300X results: $artifacts"
exit "$status"
