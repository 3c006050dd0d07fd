"""Tiny random-weight targets for fast, exact (float64) tests of pure logic."""

from __future__ import annotations

import torch


def word_tokenizer(vocab_size: int):
    """A real (tokenizers WordLevel) tokenizer whose tokens are 'w0'...'wN', one per id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    # single_word: the specials must not match inside other words ("w13" is one token)
    eos, unk = AddedToken("w0", single_word=True, special=True), AddedToken("w1", single_word=True, special=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token=unk)


def tiny_target(
    arch: str = "llama", vocab_size: int = 64, dtype=torch.float64, seed: int = 0, attn: str = "sdpa",
    tokenizer=None, **overrides
):
    """A random-weight model with the given architecture, wrapped as a TorchTarget.

    ``tokenizer`` (e.g. the real SmolLM2 one, for byte-level text with half-decoded characters)
    replaces the word tokenizer; the vocabulary then is the tokenizer's."""
    if tokenizer is not None:
        vocab_size = len(tokenizer)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from draftmesh.backend import TorchTarget

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **common))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            num_hidden_layers=4,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Spread the logits so argmax is not a near-tie at random init.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.config._attn_implementation = attn  # sdpa is the production path; eager is faster in float64
    model.to(dtype).eval()
    return TorchTarget(model, tokenizer if tokenizer is not None else word_tokenizer(vocab_size), name=f"tiny-{arch}")
