"""vitserve's embeddings drive a real HF LLM exactly as its own vision tower would (docs/integration.md).

A tiny full Qwen2-VL written with save_pretrained: logits computed from embeddings that travelled
vitserve encoder -> wire format -> EmbeddingReceiver equal the full model's logits on the raw image.
"""

from __future__ import annotations

import time

import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling

from tests.checkpoints import make_checkpoint
from vitserve.model import load_encoder
from vitserve.processors import load_image_processor
from vitserve.rpc import EmbeddingReceiver
from vitserve.rpc.sender import LLMSender
from vitserve.rpc.wire import ImageEmbedding

IMAGE_TOKEN = 5  # the tiny vocabulary (64) has no room for Qwen's real <|image_pad|> id


def _image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def _prompt(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [1, 2, *([IMAGE_TOKEN] * num_tokens), 3, 4]
    input_ids = torch.tensor([ids])  # (1, seq)
    mm_token_type_ids = (input_ids == IMAGE_TOKEN).int()  # 1 marks image positions (M-RoPE needs it)
    return input_ids, mm_token_type_ids


def _received_embedding(tmp_path, encoded, item) -> torch.Tensor:
    endpoint = f"ipc://{tmp_path}/llm.sock"
    with EmbeddingReceiver(endpoint, bind=True) as receiver:
        sender = LLMSender(endpoint)
        try:
            message = ImageEmbedding(
                request_id="r-1",
                image_index=0,
                num_images=1,
                image_id="0" * 64,
                model="tiny",
                grid_thw=item.grid_thw,
                embedding=encoded.embedding,
                deepstack=list(encoded.deepstack),
            )
            sender.send(message, deadline=time.monotonic() + 30)
            msg = receiver.recv(timeout_s=10)
        finally:
            sender.close()
    assert msg.grid_thw == list(item.grid_thw) or tuple(msg.grid_thw) == item.grid_thw
    return msg.embedding


def test_logits_from_vitserve_embeddings_equal_full_model(tmp_path):
    ckpt = make_checkpoint("qwen2_vl", tmp_path / "ckpt")
    item = load_image_processor(str(ckpt)).preprocess(_image(92, 60, seed=3))
    encoded = load_encoder(str(ckpt)).encode([item])[0]
    embedding = _received_embedding(tmp_path, encoded, item)
    assert embedding.shape[0] == item.num_tokens

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model.config.image_token_id = IMAGE_TOKEN
    input_ids, mm_token_type_ids = _prompt(item.num_tokens)
    grid = torch.tensor([item.grid_thw])
    with torch.inference_mode():
        reference = model(
            input_ids=input_ids,
            pixel_values=item.pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids,
        ).logits
        ours = model(
            input_ids=input_ids,
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids,
            mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=[embedding])},
        ).logits
        # inputs_embeds route: scatter the embedding into the token embeddings by hand.
        embeds = model.get_input_embeddings()(input_ids)
        embeds[input_ids == IMAGE_TOKEN] = embedding
        by_hand = model(
            input_ids=input_ids,
            inputs_embeds=embeds,
            image_grid_thw=grid,
            mm_token_type_ids=mm_token_type_ids,
        ).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_hand, reference, rtol=1e-5, atol=1e-5)
    # The check can fail: a different image gives different logits.
    other = load_encoder(str(ckpt)).encode(
        [load_image_processor(str(ckpt)).preprocess(_image(92, 60, seed=4))]
    )
    assert not torch.allclose(other[0].embedding, embedding)
