"""e2e tests run a real uvicorn server on an ephemeral 127.0.0.1 port (tests/e2e/live.py), real HTTP."""
