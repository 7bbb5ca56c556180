"""Everything of vitserve that runs inside vLLM (docs/vllm.md, "vitserve's vLLM connector"): the vLLM glue
(glue.py, loaded by vLLM as `vitserve.vllm_connector`, a re-export), the store that receives and holds the
embeddings (store.py) and the connector's side of the wire key (keys.py). Nothing here imports vLLM but glue.py,
and nothing imports what `pip install --no-deps vitserve` into vLLM's environment would lack."""
