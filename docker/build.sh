#!/usr/bin/env bash
# Build a vitserve image with the versions pinned in docker/versions.env (the one place they are).
#   bash docker/build.sh cpu            -> vitserve:cpu
#   bash docker/build.sh cuda [TAG]     -> vitserve:cuda, or TAG
# Extra arguments after the tag go to `docker build` (e.g. --progress plain).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: docker/build.sh cpu|cuda [TAG] [docker build args...]}
case "$kind" in cpu | cuda) ;; *) echo "docker/build.sh: kind must be cpu or cuda, got '$kind'" >&2; exit 2 ;; esac
tag=${2:-vitserve:$kind}
shift $(($# < 2 ? $# : 2))
args=()
while IFS= read -r line; do
  case "$line" in '' | '#'*) continue ;; esac
  args+=(--build-arg "$line")
done <docker/versions.env
exec docker build -f "docker/Dockerfile.$kind" -t "$tag" "${args[@]}" "$@" .
