"""What the speculative-decoding end-to-end tests share: prompts, the sampling settings every
proposer is run under, and runs with speculation on and off (the off run cached per engine)."""

from __future__ import annotations

import random

import numpy as np

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput

NEW_TOKENS = 14


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(3, 30))] for _ in range(count)]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, n=3, max_tokens=NEW_TOKENS, ignore_eos=True),
    # Settings applied per position: penalties, bias, bad words, min_tokens' hidden stop tokens.
    SamplingParams(
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        logit_bias={36: 2.0},
        bad_words_token_ids=[[36, 36, 36]],
        min_tokens=6,
        stop_token_ids=[61],
        logprobs=1,
    ),
]


def outcome(outputs: list[RequestOutput]) -> list:
    return [
        [
            (
                c.token_ids,
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else [sorted(d) for d in c.logprobs],
            )
            for c in output.outputs
        ]
        for output in outputs
    ]


def logprob_values(outputs: list[RequestOutput]) -> np.ndarray:
    return np.array(
        [lp.logprob for o in outputs for c in o.outputs for d in c.logprobs or [] for lp in d.values()],
        dtype=np.float64,
    )


def run(path: str, engine: dict, speculative: dict | None, prompt_seed: int = 0) -> tuple[list, np.ndarray, LLM]:
    """Every prompt under every setting of PARAMS, in one batch."""
    llm = LLM(model=path, **engine, speculative_config=speculative)
    batch = prompts(prompt_seed)
    outputs = llm.generate(batch * len(PARAMS), [p for p in PARAMS for _ in batch], use_tqdm=False)
    llm.llm_engine.check_idle()
    return outcome(outputs), logprob_values(outputs), llm


_references: dict = {}


def reference(path: str, engine: dict, prompt_seed: int = 0) -> tuple[list, np.ndarray]:
    key = (path, tuple(sorted(engine.items())), prompt_seed)
    if key not in _references:
        results, values, llm = run(path, engine, None, prompt_seed)
        llm.shutdown()
        _references[key] = results, values
    return _references[key]


def check_aborts_in_flight(llm: LLM, batch: list[list[int]], params: SamplingParams, expected: list[list[int]]) -> None:
    """Abort three requests (while waiting, at the first decode, mid-verify) as the engine
    speculates; the others must give `expected` (their tokens with speculation off), and the
    engine must end idle."""
    engine = llm.llm_engine
    ids = [engine.add_request(prompt, params) for prompt in batch]
    results, step, aborted = {}, 0, set()
    while engine.has_unfinished_requests():
        step += 1
        if step in (1, 3, 6):
            aborted.add(ids[step // 3])
            engine.abort_requests([ids[step // 3]])
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0]
    assert len(aborted) == 3 and not aborted & set(results)
    for i, req_id in enumerate(ids):
        if req_id not in aborted:
            assert results[req_id].token_ids == expected[i]
    while engine.engine_core.has_work():
        engine.step()
    engine.check_idle()


def save_eagle_head(path: str, target_config, method: str, seed: int = 0, draft_vocab_size: int = 64) -> None:
    """A random EAGLE-1 (`method` "eagle") or EAGLE-3 head for `target_config`, saved in the
    published layout: config.json and model.safetensors with the published tensor names."""
    import copy
    import json
    import os

    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = target_config.hidden_size, target_config.intermediate_size
    heads, kv_heads = target_config.num_attention_heads, target_config.num_key_value_heads
    head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    vocab = target_config.vocab_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * (1.0 / shape[-1]) ** 0.5 * 2

    def norm() -> torch.Tensor:
        return 0.5 + torch.rand(hidden, generator=generator)

    attn_in = hidden if method == "eagle" else 2 * hidden
    layer = "layers.0" if method == "eagle" else "midlayer"
    tensors = {
        f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        f"{layer}.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        f"{layer}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{layer}.post_attention_layernorm.weight": norm(),
        f"{layer}.mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}.mlp.down_proj.weight": rand(hidden, inter),
        # Published heads may carry the target's embedding; the engine shares the target's.
        "embed_tokens.weight": rand(vocab, hidden),
    }
    config = copy.deepcopy(target_config).to_dict()
    config.update(num_hidden_layers=1)
    if method == "eagle":
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        config["architectures"] = ["LlamaForCausalLM"]
    else:
        del tensors["embed_tokens.weight"]
        target_ids = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
        tensors.update(
            {
                f"{layer}.input_layernorm.weight": norm(),
                f"{layer}.hidden_norm.weight": norm(),
                "fc.weight": rand(hidden, 3 * hidden),
                "norm.weight": norm(),
                "lm_head.weight": rand(draft_vocab_size, hidden),
                "d2t": target_ids - torch.arange(draft_vocab_size),
                "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True),
            }
        )
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size)
    os.makedirs(path, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as file:
        json.dump(config, file)
