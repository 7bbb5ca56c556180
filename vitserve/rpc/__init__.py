"""Wire messages, their codec, the ZMQ sender and the LLM-side EmbeddingReceiver (SPEC §3)."""
