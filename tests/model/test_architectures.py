"""Every supported architecture (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) matches
Hugging Face transformers in fp32, through the engine's paged, chunked path."""

import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from tests.helpers import hf_tiny_config


def _tiny(kind: str, out, tokenizer_dir):
    import transformers
    from transformers import AutoTokenizer

    cfg, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    extra = {"head_dim": 24} if kind == "qwen3" else {}  # Qwen3: head_dim independent of hidden/heads
    torch.manual_seed(0)
    model = model_cls(cfg(**hf_tiny_config(**extra))).eval()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_engine_matches_hf(kind, tmp_path, smollm_dir):
    hf = _tiny(kind, tmp_path, smollm_dir)
    prompt = [(7 * i + 3) % 40000 + 100 for i in range(37)]
    with Engine(EngineConfig(model=str(tmp_path), chunk_size=16, block_size=4, num_blocks=64)) as eng:
        out = eng.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=5),
            use_tqdm=False,
        )[0]
        eng.drain()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.token_ids == greedy[0, len(prompt) :].tolist()
    worst = max(
        abs(lp.logprob - ref[i - 1, prompt[i]].item()) for i, lp in enumerate(out.prompt_logprobs) if lp
    )
    n = len(prompt)
    worst = max(
        [worst] + [abs(lp.logprob - ref[n - 1 + k, lp.token_id].item()) for k, lp in enumerate(out.logprobs)]
    )
    assert worst < 1e-4, f"{kind}: max |logprob - HF| = {worst:.2e}"
