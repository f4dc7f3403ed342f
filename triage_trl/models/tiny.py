"""Tiny offline models for tests, benchmarks and smoke runs (no hub access needed).

``save_tiny_qwen3(path)`` writes a randomly initialised Qwen3 causal LM and a byte-level BPE
tokenizer trained on a few built-in sentences, as an ordinary ``from_pretrained`` folder that
transformers and vLLM both load; ``save_tiny_qwen3_moe(path)`` the same for a Qwen3-MoE (a few
experts, top-2 routing); ``save_tiny_model(path, architecture, **config)`` for any other transformers
family. Every linear layer and expert of the Qwen3 models has dimensions that are multiples of 16, so the
whole decoder can run in NVFP4.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "What is 3 + 4? Let me think step by step.\nThe answer is \\boxed{7}.",
    "Compute 12 - 5.\nFirst, 12 - 5 = 7.\nSo the final answer is \\boxed{7}.",
    "Question: how many legs do 2 cats have?\nEach cat has 4 legs.\n2 * 4 = 8.\n\\boxed{8}",
    "The quick brown fox jumps over the lazy dog.\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "user\nassistant\nsystem\nPlease reason step by step, and put your final answer within \\boxed{}.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML template, trained offline.

    Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: str | Path, architecture: str, *, head: str = "ForCausalLM", seed: int = 0,
                    **config) -> Path:
    """Save a random tiny ``<architecture><head>`` (bf16 weights, e.g. ``"GptOss"``, ``"Cohere2"``, or ``"Qwen2"``
    with ``head="ForSequenceClassification"``) and the tiny tokenizer under ``path``; ``config`` sets the
    ``<architecture>Config`` fields (its shape: keep ``head_dim`` 64 or more, vLLM's CPU attention needs it).

    Returns:
        The folder, loadable with ``from_pretrained`` (and ``vllm.LLM`` for the architectures vLLM serves).
    """
    return _save_tiny(path, architecture, seed, head=head, **config)


def _save_tiny(path: str | Path, architecture: str, seed: int, head: str = "ForCausalLM", **config) -> Path:
    """Build a random ``<architecture><head>`` in bf16 with the tiny tokenizer's vocabulary and save both."""
    import torch
    import transformers

    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    config = getattr(transformers, f"{architecture}Config")(**{
        "vocab_size": ((len(tokenizer) + 63) // 64) * 64,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        **config,
    })
    torch.manual_seed(seed)
    model = getattr(transformers, f"{architecture}{head}")(config).to(torch.bfloat16)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _write_card(path, architecture)
    return path


def _write_card(path: Path, architecture: str) -> None:
    """A model card naming the license (this project's: the weights are random, made here), which run cards
    inherit; no ``base_model``, since the model derives from none."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(license="apache-2.0", library_name="transformers", pipeline_tag="text-generation")
    text = (f"---\n{data.to_yaml()}\n---\n\n# Tiny random {architecture} (triage-trl tests)\n\nRandomly initialised "
            "weights and a byte-level BPE tokenizer trained on a few sentences, built offline by "
            "`triage_trl.testing` for smoke runs. It knows nothing.\n")
    ModelCard(text).save(path / "README.md")


def save_tiny_qwen3(
    path: str | Path,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 64,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Save a random tiny ``Qwen3ForCausalLM`` (bf16 weights) and its tokenizer under ``path``; with
    ``tie_word_embeddings`` the ``lm_head`` is the embedding (as in SmolLM2 and the small Qwen3 models).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM``.
    """
    return _save_tiny(path, "Qwen3", seed, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, head_dim=head_dim,
                      tie_word_embeddings=tie_word_embeddings)


def save_tiny_qwen3_moe(
    path: str | Path,
    *,
    moe_intermediate_size: int = 64,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    seed: int = 0,
    **shape,
) -> Path:
    """Save a random tiny ``Qwen3MoeForCausalLM`` (bf16 weights) and its tokenizer under ``path``.

    Every decoder block is sparse: attention, a router (``mlp.gate``, a ``Qwen3MoeTopKRouter``) and ``num_experts``
    SwiGLU experts held as transformers 5's 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]); routing renormalises the top-k probabilities, as Qwen3-30B-A3B does.
    ``shape`` overrides the attention shape of ``save_tiny_qwen3`` (hidden 128, 2 blocks, 2 heads, 1 KV head,
    head_dim 64).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM``.
    """
    shape = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 64, **shape}
    return _save_tiny(path, "Qwen3Moe", seed, intermediate_size=4 * moe_intermediate_size,
                      moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
                      num_experts_per_tok=num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], **shape)
