#!/usr/bin/env bash
# The upgrade gate of a CI job: `titan-primus validate` (TorchTitan's real trainer, FP8 against bf16
# and two noise floors; docs/validate.md) with `titan-primus` from PATH. Results go to $ARTIFACTS
# (default artifacts/NAME): validate-NAME.json, validate-NAME.md (the verdicts) and
# validate-NAME.png (loss curves, tokens/s, memory). Fails when a verdict fails.
#
# usage: ci/validate.sh NAME [VALIDATE ARGUMENTS...]   e.g. ci/validate.sh cpu --quick
set -euo pipefail
name=${1:?usage: ci/validate.sh NAME [VALIDATE ARGUMENTS...]}
shift
out=${ARTIFACTS:-artifacts/$name}
mkdir -p "$out"
status=0
titan-primus validate --json "$out/validate-$name.json" --png "$out/validate-$name.png" "$@" \
    > "$out/validate-$name.md" || status=$?
cat "$out/validate-$name.md"
echo "validate results of $name: $out/validate-$name.{json,md,png}"
exit "$status"
