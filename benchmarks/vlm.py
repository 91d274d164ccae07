"""Vision-language serving offline (#18): Qwen2.5-VL-7B's shape with dummy weights, requests of
one image and a short text each, greedy with ignore_eos. Two waves in one engine: wave "miss"
brings new images (each encoded), wave "hit" the same images after another text (the prefix
cache cannot cover them; the encoder cache does). Printed per wave and in total: output tokens/s,
the encoder's share of the wall time (its runs timed with device syncs), mean and p50 TTFT.

    python benchmarks/vlm.py                       # H200: 2 x 128 requests, 448x448, 128 tokens
    python benchmarks/vlm.py --shape tiny --device cpu --num-requests 8 --output-len 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

from pagoda import LLM, SamplingParams

# Qwen/Qwen2.5-VL-7B-Instruct's published config.json (M-RoPE in transformers 5's rope_parameters).
QWEN2_5_VL_7B = {
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}
TINY = {
    "text_config": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "out_hidden_size": 64,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
    "image_token_id": 1000,
    "video_token_id": 1001,
    "vision_start_token_id": 1002,
    "vision_end_token_id": 1003,
    "tie_word_embeddings": False,
}
SHAPES = {"qwen2.5-vl-7b": QWEN2_5_VL_7B, "tiny": TINY}


def write_checkpoint_config(shape: dict, path: str) -> None:
    """config.json and the default Qwen2-VL image processor's preprocessor_config.json (weights: dummy)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessor

    Qwen2_5_VLConfig(**shape).save_pretrained(path)
    Qwen2VLImageProcessor().save_pretrained(path)


def make_prompts(shape: dict, num: int, size: int, seed: int, text_seed: int) -> list[dict]:
    """`num` prompts of 16 random text tokens, then one `size` x `size` image; images from `seed`."""
    from PIL import Image

    images = np.random.default_rng(seed)
    texts = np.random.default_rng(text_seed)
    vocab = min(shape["image_token_id"], 1000)
    image = [shape["vision_start_token_id"], shape["image_token_id"], shape["vision_end_token_id"]]
    return [
        {
            "prompt_token_ids": [*texts.integers(0, vocab, 16).tolist(), *image, 1, 2, 3],
            "multi_modal_data": {"image": Image.fromarray(images.integers(0, 256, (size, size, 3), dtype=np.uint8))},
        }
        for _ in range(num)
    ]


def run_wave(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    encoder = llm.llm_engine.engine_core.executor.worker.model_runner.encoder_runner
    encoder_before, encoded_before = encoder.encoder_seconds, encoder.num_encoded_images
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": output_tokens,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(output_tokens / wall, 1),
        "images_encoded": encoder.num_encoded_images - encoded_before,
        "encoder_s": round(encoder.encoder_seconds - encoder_before, 3),
        "encoder_share": round((encoder.encoder_seconds - encoder_before) / wall, 4),
        "ttft_mean_s": round(statistics.mean(ttfts), 4),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256, help="both waves together")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--encoder-cache-size",
        type=int,
        default=65536,
        help="encoder output tokens kept for reuse (the default holds a wave of 128 448x448 images, 256 tokens each)",
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint_config(shape, path)
        llm = LLM(
            path,
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            encoder_cache_size=args.encoder_cache_size,
        )
        llm.llm_engine.engine_core.executor.worker.model_runner.encoder_runner.timed = True
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        half = args.num_requests // 2
        # A short warm-up (first kernel compiles, first images), then the two waves.
        run_wave(llm, make_prompts(shape, 2, args.image_size, seed=99, text_seed=99), params)
        miss = run_wave(llm, make_prompts(shape, half, args.image_size, seed=1, text_seed=1), params)
        hit = run_wave(llm, make_prompts(shape, half, args.image_size, seed=1, text_seed=2), params)
        total_tokens = miss["output_tokens"] + hit["output_tokens"]
        total_wall = miss["wall_s"] + hit["wall_s"]
        summary = {
            "shape": args.shape,
            "image_size": args.image_size,
            "miss": miss,
            "hit": hit,
            "output_tok_per_s": round(total_tokens / total_wall, 1),
            "encoder_share": round((miss["encoder_s"] + hit["encoder_s"]) / total_wall, 4),
        }
        print(json.dumps(summary, indent=2))
        llm.shutdown()


if __name__ == "__main__":
    main()
