# shellcheck shell=bash
# Sourced by ci/gate.sh and the GPU jobs' scripts: every step runs and is reported, a failure does not
# stop the ones after it, so a job leaves every result it could produce. A step is one command (a
# function called as a step runs without errexit: chain its commands with &&).

failed=()

# step NAME COMMAND... (COMMAND sees the caller's variables: bash scopes them dynamically, so this
# function declares no local of its own)
step() {
    echo "== $1" >&2
    "${@:2}" || failed+=("$1 (exit $?)")
}

# The steps that failed, if any; the status for the script to exit with.
finish() {
    if ((${#failed[@]})); then
        printf 'failed: %s\n' "${failed[@]}" >&2
        return 1
    fi
}
