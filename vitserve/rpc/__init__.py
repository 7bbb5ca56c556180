"""Wire messages, their codec, the ZMQ sender and the LLM-side EmbeddingReceiver (docs/integration.md)."""

from vitserve.rpc.receiver import EmbeddingReceiver
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding, WireError, decode_embedding_message, encode_embedding_message

__all__ = [
    "EmbeddingReceiver",
    "ImageEmbedding",
    "LLMSender",
    "WireError",
    "decode_embedding_message",
    "encode_embedding_message",
]
