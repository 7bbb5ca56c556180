#!/usr/bin/env bash
# The container smoke test, for a machine with Docker (Compose v2) and curl: build the CPU image with the
# pinned versions, start vitserve beside the stand-in receiver (docker/compose.yaml), wait until both are
# healthy, encode one image over HTTP, check the response (and its traceparent header) and that the
# receiver got its embedding, then stop and check that vitserve drained and exited 0. Everything is
# removed at the end, pass or fail.
#   bash docker/smoke.sh              (SMOKE_TIMEOUT_S=600 bounds the wait for readiness)
set -euo pipefail
cd "$(dirname "$0")/.."
project=vitserve-smoke
compose=(docker compose --env-file docker/versions.env -f docker/compose.yaml -p "$project")
url=http://127.0.0.1:8100
timeout_s=${SMOKE_TIMEOUT_S:-600}
trace_id=0af7651916cd43dd8448eb211c80319c

fail() {
  echo "smoke: FAIL: $*" >&2
  "${compose[@]}" logs --no-color --tail 40 >&2 || true
  exit 1
}
cleanup() { "${compose[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

health() { docker inspect --format '{{.State.Health.Status}}' "$("${compose[@]}" ps -q "$1")"; }

echo "smoke: building and starting ($project)"
"${compose[@]}" up --build --detach

echo "smoke: waiting up to ${timeout_s}s for /ready and both healthchecks"
deadline=$((SECONDS + timeout_s))
until curl -fsS "$url/ready" >/dev/null 2>&1 && [ "$(health vitserve)" = healthy ] \
  && [ "$(health receiver)" = healthy ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "not ready and healthy after ${timeout_s}s"
  sleep 2
done
[ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ] || fail "/health is not 200"

echo "smoke: encoding one image"
# A 64x48 red PNG made inside the image (it has Pillow), so the host needs nothing but Docker and curl.
png_b64=$("${compose[@]}" exec -T vitserve python -c \
  "import base64, io; from PIL import Image; b = io.BytesIO(); Image.new('RGB', (64, 48), 'red').save(b, 'PNG'); print(base64.b64encode(b.getvalue()).decode())")
headers=$(mktemp)
response=$(curl -fsS -D "$headers" -X POST "$url/encode" -H 'Content-Type: application/json' \
  -H "traceparent: 00-$trace_id-b7ad6b7169203331-01" \
  -d "{\"images\": [{\"b64\": \"$png_b64\"}]}") || fail "POST /encode did not answer 200"
grep -qi "^traceparent: 00-$trace_id-" "$headers" || fail "the response does not continue trace $trace_id"
rm -f "$headers"
echo "smoke: $response" | cut -c1-300
request_id=$(printf '%s' "$response" | "${compose[@]}" exec -T vitserve python -c 'import json, sys; r = json.load(sys.stdin); assert r["images"][0]["num_tokens"] > 0, r; print(r["request_id"])') \
  || fail "the /encode response has no image with tokens"
sleep 1
"${compose[@]}" logs --no-color receiver | grep -q "\"request_id\": \"$request_id\"" \
  || fail "the receiver never printed request $request_id"

echo "smoke: stopping (SIGTERM, drain)"
"${compose[@]}" stop --timeout 150 vitserve
code=$(docker inspect --format '{{.State.ExitCode}}' "$("${compose[@]}" ps -aq vitserve)")
[ "$code" = 0 ] || fail "vitserve exited $code after SIGTERM, not 0"
echo "smoke: PASS"
