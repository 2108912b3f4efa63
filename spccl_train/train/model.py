"""Models built from :class:`ModelConfig` with ``transformers``: random init, no downloads."""

from __future__ import annotations

import torch

from .config import ModelConfig

__all__ = ["build_model", "count_parameters"]


def build_model(cfg: ModelConfig, device: torch.device, *, eos_id: int = 0) -> torch.nn.Module:
    """A causal LM of the configured shape, initialised directly on ``device``.

    Uses SDPA attention. Initialising on the device avoids a slow CPU init of billions of
    weights; the caller seeds torch first so every rank starts from the same weights.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    intermediate = cfg.intermediate or 4 * cfg.hidden
    if cfg.arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_position,
            n_embd=cfg.hidden,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=intermediate,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.Starcoder2Config(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden,
            intermediate_size=intermediate,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_head or cfg.n_head,
            max_position_embeddings=cfg.max_position,
            rope_theta=cfg.rope_theta,
            sliding_window=None,
            attention_dropout=cfg.dropout,
            residual_dropout=cfg.dropout,
            embedding_dropout=cfg.dropout,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
        )
        cls = transformers.Starcoder2ForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(config)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
