"""Tiny random vision-language checkpoints built in the tests (nothing is downloaded): a LLaVA-1.5
config with a CLIP tower over a Llama decoder, saved with save_pretrained together with a locally
built word-level tokenizer that has the image token and a saved CLIP image-processor config; the
HF model is the numerical reference (greedy tokens and top-2 margins per step)."""

from __future__ import annotations

import io

import numpy as np
import torch
from model_utils import randomize_
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedTokenizerFast,
)

IMAGE_SIZE = 30
PATCH_SIZE = 6
# (30 / 6)^2 patches, the CLS token dropped ("default" strategy).
TOKENS_PER_IMAGE = 25
WORDS = [f"w{i}" for i in range(200)]
SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]
VOCAB = len(SPECIALS) + len(WORDS) + 4
IMAGE_TOKEN_ID = SPECIALS.index("<image>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def llava_config() -> LlavaConfig:
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
            projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )


def save_tiny_llava(path: str, seed: int = 1234) -> LlavaForConditionalGeneration:
    """Save the checkpoint, tokenizer and image processor to `path`; returns the HF model (eval)."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config()).float()
    randomize_(model)
    model.eval()
    model.save_pretrained(path)
    tokenizer_of_words().save_pretrained(path)
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return model


def tokenizer_of_words(extra_specials: list[str] = ()) -> PreTrainedTokenizerFast:
    """Word-level: the special tokens, w0..w199 and a few chat words; `extra_specials` after them."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + ["user", "assistant", ":", "x", *extra_specials])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", *extra_specials]})
    tokenizer.chat_template = CHAT_TEMPLATE
    # A BOS token first, as Llama's tokenizers add.
    from tokenizers import processors

    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
QWEN_IMAGE_TEXT = "".join(QWEN_SPECIALS)


def qwen2_5_vl_config():
    """Qwen2.5-VL with a two-block vision tower (block 1 full attention, block 0 windows of 2x2
    merged patches: 56 px) and M-RoPE sections (2, 3, 3) over 16-wide heads."""
    from transformers import Qwen2_5_VLConfig

    ids = {token: VOCAB + i for i, token in enumerate(QWEN_SPECIALS)}
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB + len(QWEN_SPECIALS),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def save_tiny_qwen2_5_vl(path: str, seed: int = 1234):
    """Save the checkpoint, a tokenizer with Qwen's vision tokens and a Qwen2-VL image processor
    (56x56 to 224x224 pixels: 4 to 64 merged tokens an image); returns the HF model (eval)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config()).float()
    randomize_(model)
    model.eval()
    model.save_pretrained(path)
    tokenizer_of_words(QWEN_SPECIALS).save_pretrained(path)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224).save_pretrained(path)
    return model


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@torch.inference_mode()
def hf_vlm_greedy(
    model: torch.nn.Module, prompt_ids: list[int], mm_inputs: dict[str, torch.Tensor], max_new_tokens: int
) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy continuation by the HF model's generate (explicit attention mask, eos ignored):
    the tokens, the top-2 logit margin at each step, and the first step's logits."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **mm_inputs,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = [step[0].float() for step in out.logits]
    margins = [float(top2[0] - top2[1]) for top2 in (step.topk(2).values for step in logits)]
    return out.sequences[0, len(prompt_ids) :].tolist(), margins, logits[0]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels and holds none: what a decompression bomb
    looks like to a decoder that reads the header first (cheap to send, huge to decode)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
