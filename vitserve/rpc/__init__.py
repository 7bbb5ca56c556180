"""Wire messages (version 3, docs/wire.md), their codec, the ZMQ sender and the LLM-side EmbeddingReceiver."""

from vitserve.rpc.delivery import Delivery
from vitserve.rpc.receiver import EmbeddingReceiver
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import (
    ImageEmbedding,
    VideoGroupRef,
    WireError,
    decode_embedding_message,
    encode_embedding_message,
)

__all__ = [
    "Delivery",
    "EmbeddingReceiver",
    "ImageEmbedding",
    "LLMSender",
    "VideoGroupRef",
    "WireError",
    "decode_embedding_message",
    "encode_embedding_message",
]
