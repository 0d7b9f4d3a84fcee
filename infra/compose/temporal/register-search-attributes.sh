#!/bin/sh
# Registers the search attributes TrainingRun upserts (infra/temporal_server.py
# SEARCH_ATTRIBUTES; tests/unit/test_compose.py keeps the two lists equal).
# Idempotent: an attribute that exists is left alone.
set -eu
NS="${TEMPORAL_NAMESPACE:-default}"
until temporal operator namespace describe --namespace "$NS" >/dev/null 2>&1; do
  echo "waiting for Temporal at $TEMPORAL_ADDRESS and namespace $NS"
  sleep 2
done
existing="$(temporal operator search-attribute list --namespace "$NS")"
for pair in RlStep=Int RlReward=Double RlPolicyVersion=Int RlStatus=Keyword; do
  name="${pair%%=*}"
  kind="${pair#*=}"
  if echo "$existing" | grep -qw "$name"; then
    echo "search attribute $name exists"
  else
    temporal operator search-attribute create --namespace "$NS" --name "$name" --type "$kind"
  fi
done
