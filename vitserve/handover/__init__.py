"""The hand-over to the LLM server behind the front door (--llm_url, docs/vllm.md): how a chat request's
embeddings reach it (inline in the body, or as encoder-cache files with --llm_transport ec_storage), the
checks they pass first, and the HTTP client that sends the request. Imports no HTTP server layer
(starlette, fastapi, vitserve.api): the front door (api/chat.py) calls it."""
